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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from adaptive_eagle.draft_head import Eagle3DraftHead, repeat_kv

DEFAULT_TTT_STEPS = 7
DEFAULT_STEP_DECAY = 0.8


@dataclass(frozen=True)
class TTTBatch:
    input_ids: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T] 1 on assistant tokens
    lengths: torch.Tensor  # [B] real lengths (right padding beyond)
    aux: torch.Tensor  # [B, T, 3 * H_target] target aux features
    target_logits: torch.Tensor  # [B, T, draft_vocab] target logits restricted to the draft vocab
    target_argmax: torch.Tensor | None = None  # [B, T] target's full-vocab argmax (exact acceptance)


@dataclass(frozen=True)
class TTTOutput:
    loss: torch.Tensor  # scalar: sum_j decay**j * mean CE_j (+ router aux loss)
    step_loss: list[float]  # [steps] mean CE per step
    step_correct: list[int]  # [steps] positions whose draft argmax equals the target's
    step_count: list[int]  # [steps] valid positions per step
    step_accept: list[int]  # [steps] chains (one per start position) accepted through step j
    step_eligible: list[int]  # [steps] chains accepted through j-1 whose step j can be scored


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
    """The TTT attention pattern for one batch: step-0 keys causal + the diagonal chain."""

    def __init__(self) -> None:
        self.k0 = self.v0 = None
        self.diag_k: list[torch.Tensor] = []  # each [B, kv_heads, T, d]
        self.diag_v: list[torch.Tensor] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n_rep = q.shape[1] // k.shape[1]
        if self.k0 is None:
            self.k0, self.v0 = k, v
            return F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), is_causal=True)
        self.diag_k.append(k)
        self.diag_v.append(v)
        scale = 1.0 / math.sqrt(q.shape[-1])
        k0, v0 = repeat_kv(self.k0, n_rep), repeat_kv(self.v0, n_rep)
        t = q.shape[2]
        prefix = torch.matmul(q, k0.transpose(-1, -2)) * scale  # [B, h, T, T]
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        prefix = prefix.masked_fill(~causal, float("-inf"))
        dk = torch.stack([repeat_kv(x, n_rep) for x in self.diag_k], dim=-2)  # [B, h, T, j, d]
        dv = torch.stack([repeat_kv(x, n_rep) for x in self.diag_v], dim=-2)
        diag = (q.unsqueeze(-2) * dk).sum(-1) * scale  # [B, h, T, j]
        probs = torch.softmax(torch.cat([prefix, diag], dim=-1).float(), dim=-1).to(q.dtype)
        out = torch.matmul(probs[..., :t], v0) + (probs[..., t:].unsqueeze(-1) * dv).sum(-2)
        return out


def ttt_loss(
    head: Eagle3DraftHead,
    batch: TTTBatch,
    steps: int = DEFAULT_TTT_STEPS,
    decay: float = DEFAULT_STEP_DECAY,
) -> TTTOutput:
    """Unrolled TTT loss over `steps` steps (see the module docstring)."""
    b, t = batch.input_ids.shape
    attend = TTTAttention()
    positions = torch.arange(t, device=batch.input_ids.device)[None].expand(b, t)
    hidden = batch.aux
    total = batch.aux.new_zeros((), dtype=torch.float32)
    step_loss, step_correct, step_count, step_accept, step_eligible = [], [], [], [], []
    alive = torch.ones(b, t, dtype=torch.bool, device=batch.input_ids.device)  # chain accepted so far
    d2t_ids = head.draft_to_target
    for j in range(steps):
        valid = step_valid_mask(batch.loss_mask, batch.lengths, j)
        tokens = shift_left(batch.input_ids, j + 1)
        out = head.step(tokens, hidden, positions + j, attend, logits_rows=valid)
        hidden = out.hidden
        n = int(valid.sum())
        if n == 0:
            for lst in (step_correct, step_count, step_accept, step_eligible):
                lst.append(0)
            step_loss.append(0.0)
            alive = alive & valid
            continue
        tgt_logits = shift_left(batch.target_logits, j + 1)[valid].float()  # [N, Vd]
        logp = torch.log_softmax(out.logits.float(), dim=-1)
        ce = -(torch.softmax(tgt_logits, dim=-1) * logp).sum(-1).mean()
        total = total + (decay**j) * ce + head.cfg.router_aux_loss_coef * out.aux_loss
        with torch.no_grad():
            pred = logp.argmax(-1)
            if batch.target_argmax is not None:
                truth = shift_left(batch.target_argmax, j + 1)[valid]
                hit = d2t_ids[pred] == truth
            else:
                hit = pred == tgt_logits.argmax(-1)
            hit_full = torch.zeros(b, t, dtype=torch.bool, device=hit.device)
            hit_full[valid] = hit
            step_eligible.append(int((alive & valid).sum()))
            alive = alive & hit_full & valid
            step_loss.append(float(ce))
            step_correct.append(int(hit.sum()))
            step_count.append(n)
            step_accept.append(int(alive.sum()))
    return TTTOutput(total, step_loss, step_correct, step_count, step_accept, step_eligible)


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
