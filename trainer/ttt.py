"""Training-time test (TTT): the unrolled EAGLE-3 loss, efficiently.

Owns: the per-batch loss of a draft head given the target's features. Must not touch: data
loading, optimisers, checkpoints.

Alignment. For a sequence x_0..x_{T-1} the target gives aux features a_t and final hidden s_t
(s_t's logits predict x_{t+1}). Head step j at position t reads the token x_{t+j+1} and the
hidden a_t (j = 0) or the head's own step-(j-1) output at position t (j > 0), sits at rotary
position t + j, and predicts x_{t+j+2}, whose target distribution is softmax(logits(s_{t+j+1}))
restricted to the draft vocabulary. Step j is weighted 0.8**j and only counts where x_{t+j+2}
is a loss-masked (assistant) token.

Attention pattern (exactly what drafting at inference sees): at step j the query at position t
attends to the step-0 keys of positions s <= t (the real prefix) and to its own chain, the keys
of steps 1..j at position t (the diagonal). Scores are a [T, T] causal block plus j diagonal
columns, so a step costs O(T^2), not O((jT)^2) as when the unrolled sequence is materialised.

Memory (long records). With `attention_chunk` (the default) the prefix is attended one key block at a
time with a running log-sum-exp and the chain's diagonal keys are merged in exactly
(trainer/long_attention.py), so no [T, T] score matrix is ever kept: peak memory grows linearly with T
and rows up to the target's context length train on one worker. `attention_chunk=None` keeps the
dense scores (the reference the chunked path is tested equal to, in float64: loss and gradients).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from adaptive_eagle.draft_head import Eagle3DraftHead, repeat_kv
from trainer.long_attention import DEFAULT_CHUNK, block_attention, dense_partial, merge

DEFAULT_TTT_STEPS = 7
DEFAULT_STEP_DECAY = 0.8


@dataclass(frozen=True)
class TTTBatch:
    input_ids: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T] 1 on assistant tokens
    lengths: torch.Tensor  # [B] real lengths (right padding beyond)
    aux: torch.Tensor  # [B, T, 3 * H_target] target aux features
    target_probs: torch.Tensor  # [M, draft_vocab] float32 target distribution at the rows below
    row_index: torch.Tensor  # [B, T] row of target_probs for position t (whose logits predict t+1); -1: none
    target_argmax: torch.Tensor | None = None  # [B, T] target's full-vocab argmax (exact acceptance)

    @staticmethod
    def needed_positions(loss_mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B, T] bool: positions whose next token is a loss-masked real token (target rows we need)."""
        need = torch.zeros_like(loss_mask, dtype=torch.bool)
        need[:, :-1] = loss_mask[:, 1:].bool()
        pos = torch.arange(loss_mask.shape[1], device=loss_mask.device)[None]
        return need & (pos + 1 < lengths[:, None])

    @classmethod
    def build(cls, input_ids, loss_mask, lengths, aux, logits_fn, target_argmax=None) -> "TTTBatch":
        """logits_fn(bool mask [B, T]) -> [M, draft_vocab] target logits at those positions."""
        need = cls.needed_positions(loss_mask, lengths)
        row_index = torch.full(need.shape, -1, dtype=torch.long, device=need.device)
        row_index[need] = torch.arange(int(need.sum()), device=need.device)
        probs = torch.softmax(logits_fn(need).float(), dim=-1)
        return cls(input_ids, loss_mask, lengths, aux, probs, row_index, target_argmax)


class SoftCrossEntropy(torch.autograd.Function):
    """Mean over rows of -sum_v p_v log_softmax(z)_v, fused: float32 math, grad (softmax(z) - p) / N."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        zf = z.float()
        lse = torch.logsumexp(zf, dim=-1)  # [N]
        loss = (lse - (p * zf).sum(-1)).mean()
        ctx.save_for_backward(z, p, lse)
        return loss

    @staticmethod
    def backward(ctx, grad):
        z, p, lse = ctx.saved_tensors
        g = torch.exp(z.float() - lse[:, None]).sub_(p).mul_(grad / z.shape[0])
        return g.to(z.dtype), None


@dataclass(frozen=True)
class TTTOutput:
    loss: torch.Tensor  # scalar: sum_j decay**j * mean CE_j (+ router aux loss)
    step_loss: list[float]  # [steps] mean CE per step
    step_correct: list[int]  # [steps] positions whose draft argmax equals the target's
    step_count: list[int]  # [steps] valid positions per step
    step_accept: list[int]  # [steps] chains (one per start position) accepted through step j
    step_eligible: list[int]  # [steps] chains accepted through j-1 whose step j can be scored
    row_position: torch.Tensor | None = None  # [N] context position of each chain row (its start t)
    row_eligible: torch.Tensor | None = None  # [steps, N] bool: row's chain accepted through j-1, step j scorable
    row_accepted: torch.Tensor | None = None  # [steps, N] bool: row's chain accepted through step j


def step_valid_mask(loss_mask: torch.Tensor, lengths: torch.Tensor, j: int) -> torch.Tensor:
    """[B, T] bool: step j at position t predicts x_{t+j+2}, which must exist and be masked in."""
    b, t = loss_mask.shape
    shift = j + 2
    valid = torch.zeros(b, t, dtype=torch.bool, device=loss_mask.device)
    if shift < t:
        valid[:, : t - shift] = loss_mask[:, shift:].bool()
    pos = torch.arange(t, device=loss_mask.device)[None]
    return valid & (pos + shift < lengths[:, None])


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, t] <- x[:, t + n] along dim 1, padding the tail with `fill`."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)


class TTTAttention:
    """The TTT attention pattern: step 0 runs over every position (causal); later steps run only
    for the chain rows, each attending to the step-0 keys of its own prefix plus its own chain."""

    def __init__(self, row_batch: torch.Tensor, row_pos: torch.Tensor, chunk: int | None = None) -> None:
        self.row_batch, self.row_pos = row_batch, row_pos  # [N] batch index and position of each chain row
        self.chunk = chunk  # None: dense scores ([T, T] a step); an int: key blocks merged by log-sum-exp
        self.k0 = self.v0 = None  # [B, kv_heads, T, d]
        self.diag_k: list[torch.Tensor] = []  # each [1, kv_heads, N, d]
        self.diag_v: list[torch.Tensor] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n_rep = q.shape[1] // k.shape[1]
        if self.k0 is None:  # step 0: [B, h, T, d]
            self.k0, self.v0 = k, v
            if self.chunk is not None:
                pos = torch.arange(q.shape[2], device=q.device)
                return torch.stack([block_attention(q[b], k[b], v[b], pos, pos, self.chunk)[0]
                                    for b in range(q.shape[0])])
            return F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), is_causal=True)
        # steps >= 1: q [1, h, N, d], one row per chain
        self.diag_k.append(k)
        self.diag_v.append(v)
        scale = 1.0 / math.sqrt(q.shape[-1])
        dk = torch.stack([repeat_kv(x, n_rep)[0] for x in self.diag_k], dim=-2)  # [h, N, j, d]
        dv = torch.stack([repeat_kv(x, n_rep)[0] for x in self.diag_v], dim=-2)
        qr = q[0]  # [h, N, d]
        diag = (qr.unsqueeze(-2) * dk).sum(-1) * scale  # [h, N, j]
        t = self.k0.shape[2]
        outs = []
        counts = torch.bincount(self.row_batch, minlength=self.k0.shape[0]).tolist()
        start = 0
        for b, n in enumerate(counts):  # rows are sorted by batch index
            if n == 0:
                continue
            sl = slice(start, start + n)
            start += n
            if self.chunk is not None:  # prefix in key blocks, the chain dense, merged exactly
                prefix = block_attention(qr[:, sl], self.k0[b], self.v0[b], self.row_pos[sl],
                                         torch.arange(t, device=q.device), self.chunk)
                outs.append(merge(*prefix, *dense_partial(diag[:, sl], dv[:, sl]))[0])
                continue
            k0, v0 = repeat_kv(self.k0[b : b + 1], n_rep)[0], repeat_kv(self.v0[b : b + 1], n_rep)[0]  # [h, T, d]
            prefix = torch.matmul(qr[:, sl], k0.transpose(-1, -2)) * scale  # [h, n, T]
            hidden = torch.arange(t, device=q.device)[None, :] > self.row_pos[sl][:, None]  # [n, T]
            prefix = prefix.masked_fill(hidden, float("-inf"))
            stats_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
            probs = torch.softmax(torch.cat([prefix, diag[:, sl]], dim=-1).to(stats_dtype), dim=-1).to(q.dtype)
            outs.append(torch.matmul(probs[..., :t], v0) + (probs[..., t:].unsqueeze(-1) * dv[:, sl]).sum(-2))
        return torch.cat(outs, dim=1)[None]  # [1, h, N, d]


def score_step(logits: torch.Tensor, target_p: torch.Tensor, truth: torch.Tensor | None, d2t_ids: torch.Tensor,
               valid_rows: torch.Tensor, alive: torch.Tensor):
    """One TTT step's loss and acceptance over its chain rows: (ce, hit, eligible, alive). ce: the soft
    cross-entropy, a mean over the step's valid rows (logits and target_p: those rows); hit [n]: the draft's
    argmax equals the target's (its full-vocab argmax `truth` where known, else target_p's); eligible [N]:
    chains accepted through the previous step whose step this is; alive [N]: chains accepted through it."""
    ce = SoftCrossEntropy.apply(logits, target_p)
    with torch.no_grad():
        pred = logits.argmax(-1)
        hit = d2t_ids[pred] == truth if truth is not None else pred == target_p.argmax(-1)
        hit_rows = torch.zeros_like(valid_rows)
        hit_rows[valid_rows] = hit
        eligible = alive & valid_rows
    return ce, hit, eligible, eligible & hit_rows


def chain_rows(valid: list[torch.Tensor], max_rows: int | None, generator) -> torch.Tensor:
    """[B, T] bool: start positions whose chains are unrolled and scored (all, or a random subset)."""
    union = torch.stack(valid).any(0)
    if max_rows is None or int(union.sum()) <= max_rows:
        return union
    idx = union.nonzero()
    keep = torch.randperm(idx.shape[0], generator=generator)[:max_rows]
    sel = torch.zeros_like(union)
    sel[idx[keep, 0], idx[keep, 1]] = True
    return sel


def ttt_loss(
    head: Eagle3DraftHead,
    batch: TTTBatch,
    steps: int = DEFAULT_TTT_STEPS,
    decay: float = DEFAULT_STEP_DECAY,
    max_loss_rows: int | None = None,
    generator: torch.Generator | None = None,
    attention_chunk: int | None = DEFAULT_CHUNK,
) -> TTTOutput:
    """Unrolled TTT loss over `steps` steps (see the module docstring).

    Step 0 runs the head at every position (its keys are every chain's prefix). A chain's later
    steps depend only on that prefix and on its own earlier steps, so steps >= 1 run only for the
    chain rows: every scorable start position, or `max_loss_rows` of them sampled at random (the
    LM head and the vocab-sized loss dominate the cost; sampling trades gradient noise for speed).
    """
    b, t = batch.input_ids.shape
    dev = batch.input_ids.device
    valid = [step_valid_mask(batch.loss_mask, batch.lengths, j) for j in range(steps)]
    sel = chain_rows(valid, max_loss_rows, generator)  # [B, T]
    rows = sel.nonzero()  # [N, 2] sorted by (batch, position)
    if rows.shape[0] == 0:  # nothing to score (e.g. rows cut before their first trained token): a zero loss, no graph
        none = [0] * steps
        empty = torch.zeros(steps, 0, dtype=torch.bool, device=dev)
        return TTTOutput(batch.aux.new_zeros((), dtype=torch.float32), [0.0] * steps, none, none, none, none,
                         rows[:, 1], empty, empty)
    attend = TTTAttention(rows[:, 0], rows[:, 1], attention_chunk)
    positions = torch.arange(t, device=dev)[None].expand(b, t)
    total = batch.aux.new_zeros((), dtype=torch.float32)
    step_loss, step_correct, step_count, step_accept, step_eligible = [], [], [], [], []
    alive = torch.ones(rows.shape[0], dtype=torch.bool, device=dev)  # chain accepted so far
    row_eligible = torch.zeros(steps, rows.shape[0], dtype=torch.bool, device=dev)
    row_accepted = torch.zeros_like(row_eligible)
    d2t_ids = head.draft_to_target
    hidden = None
    for j in range(steps):
        valid_rows = valid[j][sel]  # [N]
        if j == 0:
            out = head.step(shift_left(batch.input_ids, 1), batch.aux, positions, attend, logits_rows=sel & valid[0])
            hidden = out.hidden[sel][None]  # [1, N, H]
        else:
            tokens = shift_left(batch.input_ids, j + 1)[sel][None]  # [1, N]
            out = head.step(tokens, hidden, (rows[:, 1] + j)[None], attend, logits_rows=valid_rows[None])
            hidden = out.hidden
        n = int(valid_rows.sum())
        if n == 0:
            for lst in (step_correct, step_count, step_accept, step_eligible):
                lst.append(0)
            step_loss.append(0.0)
            alive = alive & valid_rows
            continue
        target_rows = shift_left(batch.row_index, j + 1, fill=-1)[sel][valid_rows]  # [n]
        truth = None if batch.target_argmax is None else shift_left(batch.target_argmax, j + 1)[sel][valid_rows]
        ce, hit, row_eligible[j], alive = score_step(out.logits, batch.target_probs[target_rows], truth, d2t_ids,
                                                     valid_rows, alive)
        row_accepted[j] = alive
        total = total + (decay**j) * ce + head.cfg.router_aux_loss_coef * out.aux_loss
        step_eligible.append(int(row_eligible[j].sum()))
        step_loss.append(float(ce.detach()))
        step_correct.append(int(hit.sum()))
        step_count.append(n)
        step_accept.append(int(alive.sum()))
    return TTTOutput(total, step_loss, step_correct, step_count, step_accept, step_eligible, rows[:, 1],
                     row_eligible, row_accepted)


def acceptance_summary(correct, count, accept, eligible) -> dict:
    """Per-position acceptance j-alpha (accepted at step j given steps < j accepted, the paper's
    definition), top-1 agreement per step, and the expected accept length of a chain draft with
    the bonus token: 1 + sum_j prod_{i<=j} alpha_i."""
    alphas = [a / e if e else 0.0 for a, e in zip(accept, eligible)]
    accept_length, run = 1.0, 1.0
    for a in alphas:
        run *= a
        accept_length += run
    top1 = [c / n if n else 0.0 for c, n in zip(correct, count)]
    return {"alpha": alphas, "top1": top1, "accept_length": accept_length, "positions": count[0] if count else 0}
