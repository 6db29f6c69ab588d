"""Sequence-parallel TTT: the rows of one batch split by position over the ranks of a process group.

Owns: how a batch is cut into contiguous position shards (`split_positions`, `SeqShard`, `shard_batch`,
`shard_rows`), the ring that passes key/value blocks between neighbouring ranks (`Ring`, the autograd
Function `RingAttention`), the TTT loss over a shard (`seqpar_ttt_loss`) and the gradient sum that makes every
rank hold the whole batch's gradient (`all_reduce_gradients`), and one rank's optimizer step on its shard of
traffic rows (`sequence_parallel_step`, through trainer.step.train_step like every loop; trainer/scaleout.py runs
it on Ray Train workers). Must not touch: the TTT attention pattern and its alignment (trainer/ttt.py is the
reference this module is tested equal to), the block attention math (trainer/long_attention.py), process
groups' creation (Ray Train or the caller initialises torch.distributed), data loading.

Vocabulary. W ranks; rank r *owns* positions [start_r, end_r) of every row of the padded [B, T] batch (near
equal, earlier ranks one longer). A *block* is one rank's step-0 keys and values, [B, kv_heads, n_r, d]. The
*ring*: in each round every rank sends the block it holds to rank r+1 and receives one from rank r-1, so after
W-1 rounds every rank has seen every block, and no rank ever holds more than two blocks.

The loss, exactly as trainer/ttt.py computes it on the whole batch (float64: equal to rounding):
- step 0 runs the head at the owned positions; each query attends to the step-0 keys of every position <= its
  own: its own block and the blocks received from lower ranks, one `block_attention` each, merged by
  log-sum-exp (blocks from higher ranks are invisible and only passed on);
- steps j >= 1 run for the owned chain rows; each attends to the same prefix through a new ring over the same
  step-0 blocks, merged with its own chain (the diagonal keys of steps 1..j, local: a chain never leaves
  the rank that owns its start position);
- step j at position t reads the token x_{t+j+1} and the target row of t+j+1, which may belong to the next
  rank: a shard carries ids and target rows for `halo` (>= TTT steps) positions past its end, never the aux
  features (those are read only at owned positions). Which positions are scored (`step_valid_mask`, the
  chains of `chain_rows`) is computed on the whole rows' loss mask, which every shard carries (it is tiny), so
  shard edges, loss-masked or not, change nothing; with `max_loss_rows` every rank draws the same sample as
  one process would, given generators in the same state;
- each step's cross-entropy is a mean over the valid rows of ALL ranks (the global count is known locally,
  from the whole loss mask), so the ranks' local losses sum to the single-process loss, and the sum of their
  gradients (`all_reduce_gradients`) is the single-process gradient.

Backward (`RingAttention`): each rank keeps only its own block; backward sends the blocks round the ring again,
each with dk/dv accumulators that every rank adds its queries' contribution to (FlashAttention's backward with
the merged output and log-sum-exp), and one last hop brings each block's accumulated gradient home to its
owner. Every rank runs every ring's backward, in the same order: ring j's queries come from step j-1's output,
so the rings' backward calls are chained by data dependence, and `_Join` ties every ring's output into the
loss (a rank with no scored rows still answers its neighbours).

Not supported (refused loudly): MoE-routed heads (the router's load-balancing loss is not a sum over positions).
Load balance: with causal attention rank W-1 attends to every block and rank 0 to one; a zigzag assignment of
positions would even it out and is not done here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from adaptive_eagle.draft_head import Eagle3DraftHead, repeat_kv
from trainer.long_attention import DEFAULT_CHUNK, block_attention, block_attention_grads, dense_partial, merge
from trainer.step import StepConfig, StepStats, train_step
from trainer.ttt import (DEFAULT_STEP_DECAY, DEFAULT_TTT_STEPS, TTTBatch, TTTOutput, chain_rows, score_step,
                         shift_left, step_valid_mask)


def split_positions(t: int, world: int) -> tuple[tuple[int, int], ...]:
    """[world] contiguous (start, end) shards of positions 0..t-1, sizes differing by at most one (earlier
    ranks the longer ones; with t < world the last ranks own nothing)."""
    if world < 1:
        raise ValueError(f"world {world} must be >= 1")
    if t < 1:
        raise ValueError(f"t {t} must be >= 1")
    base, extra = divmod(t, world)
    bounds, start = [], 0
    for r in range(world):
        end = start + base + (1 if r < extra else 0)
        bounds.append((start, end))
        start = end
    return tuple(bounds)


@dataclass(frozen=True)
class SeqShard:
    """One rank's share of a batch: positions [start, end) of every row, plus a halo of ids and target rows."""

    bounds: tuple[tuple[int, int], ...]  # [world] every rank's owned (start, end)
    rank: int
    window: TTTBatch  # positions start .. start + Tw - 1 (owned, then the halo); see below
    loss_mask: torch.Tensor  # [B, T] the whole rows' loss mask (decides which positions are scored)
    lengths: torch.Tensor  # [B] the whole rows' real lengths

    # window: input_ids, loss_mask, row_index, target_argmax [B, Tw]; target_probs [M, Vd] (rows of the window
    # only); aux [B, n, 3 * H_target] at the OWNED positions only (n = end - start); lengths [B] the real tokens
    # among the owned positions (so the ranks' window lengths sum to the batch's tokens)

    @property
    def start(self) -> int:
        return self.bounds[self.rank][0]

    @property
    def end(self) -> int:
        return self.bounds[self.rank][1]

    @property
    def halo(self) -> int:
        """Positions past `end` whose ids and target rows the window carries (fewer at the rows' end)."""
        return self.start + self.window.input_ids.shape[1] - self.end


def _window_lengths(lengths: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return (lengths - start).clamp(0, end - start)


def shard_batch(batch: TTTBatch, rank: int, world: int, halo: int = DEFAULT_TTT_STEPS) -> SeqShard:
    """Rank `rank`'s shard of a whole batch (built in one process: tests, or a coordinator that ships shards)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} must be in [0, {world})")
    if halo < 0:
        raise ValueError(f"halo {halo} must be >= 0")
    t = batch.input_ids.shape[1]
    bounds = split_positions(t, world)
    start, end = bounds[rank]
    stop = min(end + halo, t)
    ri = batch.row_index[:, start:stop]
    used = ri >= 0
    row_index = torch.full_like(ri, -1)
    row_index[used] = torch.arange(int(used.sum()), device=ri.device)
    argmax = batch.target_argmax[:, start:stop] if batch.target_argmax is not None else None
    window = TTTBatch(batch.input_ids[:, start:stop], batch.loss_mask[:, start:stop],
                      _window_lengths(batch.lengths, start, end), batch.aux[:, start:end],
                      batch.target_probs[ri[used]], row_index, argmax)
    return SeqShard(bounds, rank, window, batch.loss_mask, batch.lengths)


def shard_rows(target, head: Eagle3DraftHead, rows, rank: int, world: int, halo: int = DEFAULT_TTT_STEPS,
               device: torch.device | str | None = None) -> tuple[SeqShard, int]:
    """(rank's shard, rows regenerated) of traffic rows, as `shard_batch(make_traffic_batch(...).batch)` gives,
    but the target's distribution is computed only for the window's rows (the [positions, draft vocab] target
    probabilities of a long row are what a worker cannot afford whole). Features come from the records, or one
    target prefill over the whole rows (trainer/traffic.py)."""
    from trainer.traffic import collate_rows, features

    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} must be in [0, {world})")
    device = torch.device(device) if device is not None else next(head.parameters()).device
    ids, mask, lengths = collate_rows(rows)
    aux, final, regenerated = features(target, rows)
    bounds = split_positions(ids.shape[1], world)
    start, end = bounds[rank]
    stop = min(end + halo, ids.shape[1])
    need = TTTBatch.needed_positions(mask, lengths)[:, start:stop]
    row_index = torch.full(need.shape, -1, dtype=torch.long)
    row_index[need] = torch.arange(int(need.sum()))
    with torch.no_grad():
        w_draft = target.output_embeddings()[head.draft_to_target.to(target.device)].float().to(device)  # [Vd, H]
        probs = torch.softmax(final[:, start:stop].to(device)[need.to(device)] @ w_draft.T, dim=-1)
    window = TTTBatch(ids[:, start:stop].to(device), mask[:, start:stop].to(device),
                      _window_lengths(lengths, start, end).to(device), aux[:, start:end].to(device), probs,
                      row_index.to(device))
    return SeqShard(bounds, rank, window, mask.to(device), lengths.to(device)), regenerated


class Ring:
    """Neighbour exchange over a torch.distributed group: rank r sends to r+1 and receives from r-1 (mod W).

    Counts what it did (`shifts`, `elements_sent`, `peers`) so tests can see that blocks travel by ring."""

    def __init__(self, bounds: Sequence[tuple[int, int]], group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("sequence parallel needs an initialised torch.distributed process group")
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        if len(bounds) != self.world:
            raise ValueError(f"bounds has {len(bounds)} shards, the process group {self.world} ranks")
        self.bounds = tuple(bounds)
        self._next = self._global((self.rank + 1) % self.world)
        self._prev = self._global((self.rank - 1) % self.world)
        self.shifts = 0
        self.elements_sent = 0
        self.peers: set[int] = set()

    def _global(self, r: int) -> int:
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    def positions(self, owner: int, device) -> torch.Tensor:
        """[n_owner] the positions of `owner`'s block."""
        start, end = self.bounds[owner]
        return torch.arange(start, end, device=device)

    def shift(self, x: torch.Tensor, incoming_owner: int) -> torch.Tensor:
        """Send `x` (positions along dim -2) to the next rank; return the block of `incoming_owner` from the
        previous one. Empty blocks are not sent (both sides know every block's size from the bounds). Half
        precision travels as float32."""
        n_in = self.bounds[incoming_owner][1] - self.bounds[incoming_owner][0]
        wire = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
        shape = (*x.shape[:-2], n_in, x.shape[-1])
        recv = torch.empty(shape, dtype=wire, device=x.device)
        ops = []
        if x.numel():
            send = x.to(wire).contiguous()
            ops.append(dist.isend(send, self._next, group=self.group))
            self.elements_sent += send.numel()
            self.peers.add(self._next)
        if recv.numel():
            ops.append(dist.irecv(recv, self._prev, group=self.group))
            self.peers.add(self._prev)
        for op in ops:
            op.wait()
        self.shifts += 1
        return recv.to(x.dtype)


def _slices(counts: Sequence[int]) -> list[tuple[int, slice]]:
    out, start = [], 0
    for b, n in enumerate(counts):
        out.append((b, slice(start, start + n)))
        start += n
    return out


def _visible(k_pos: torch.Tensor, q_pos: torch.Tensor) -> bool:
    return k_pos.numel() > 0 and q_pos.numel() > 0 and int(k_pos[0]) <= int(q_pos.max())


class RingAttention(torch.autograd.Function):
    """Attention of local queries over the step-0 blocks of every rank, by ring. q [h, N, d] sorted by row
    (counts[b] queries of row b), q_pos [N]; k, v [B, kv_heads, n_rank, d] this rank's block. Returns (out
    [h, N, d], lse [h, N])."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, counts, ring: Ring, chunk: int, scale: float):
        slices = _slices(counts)
        out = torch.zeros_like(q)
        cd = torch.float64 if q.dtype == torch.float64 else torch.float32
        lse = torch.full(q.shape[:2], float("-inf"), dtype=cd, device=q.device)
        kv, owner = torch.stack([k, v]), ring.rank
        for i in range(ring.world):
            if i:
                owner = (ring.rank - i) % ring.world
                kv = ring.shift(kv, owner)
            k_pos = ring.positions(owner, q.device)
            for b, sl in slices:
                if not _visible(k_pos, q_pos[sl]):
                    continue  # a block of a later rank, or no queries of this row: passed on only
                part = block_attention(q[:, sl], kv[0, b], kv[1, b], q_pos[sl], k_pos, chunk, scale)
                out[:, sl], lse[:, sl] = merge(out[:, sl], lse[:, sl], *part)
        ctx.save_for_backward(q, k, v, q_pos, out, lse)
        ctx.counts, ctx.ring, ctx.chunk, ctx.scale = counts, ring, chunk, scale
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, q_pos, out, lse = ctx.saved_tensors
        ring, chunk, scale = ctx.ring, ctx.chunk, ctx.scale
        cd = lse.dtype
        dq = torch.zeros(q.shape, dtype=cd, device=q.device)
        pack = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)]).to(cd)  # keys, values, dk, dv
        owner = ring.rank
        for i in range(ring.world):
            if i:
                owner = (ring.rank - i) % ring.world
                pack = ring.shift(pack, owner)
            k_pos = ring.positions(owner, q.device)
            for b, sl in _slices(ctx.counts):
                if not _visible(k_pos, q_pos[sl]):
                    continue
                gq, gk, gv = block_attention_grads(q[:, sl], pack[0, b], pack[1, b], q_pos[sl], k_pos,
                                                   out[:, sl].to(cd), lse[:, sl], d_out[:, sl], d_lse[:, sl], scale,
                                                   chunk)
                dq[:, sl] += gq
                pack[2, b] += gk
                pack[3, b] += gv
        # the block held now is the next rank's, with every rank's contribution: one hop takes it home
        grads = ring.shift(pack[2:], ring.rank) if ring.world > 1 else pack[2:]
        return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None, None, None, None, None


class _Join(torch.autograd.Function):
    """loss, unchanged; its backward also reaches `tensors` (with zero gradient), so every ring's backward runs
    on every rank even where nothing this rank scores depends on it."""

    @staticmethod
    def forward(ctx, loss, *tensors):
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in tensors]
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        return (grad, *(torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.shapes))


class RingTTTAttention:
    """trainer/ttt.py's TTTAttention with the prefix attended by ring: step 0 over the owned positions of every
    row, later steps for the owned chain rows (their diagonal local, merged exactly)."""

    def __init__(self, ring: Ring, row_batch: torch.Tensor, row_pos: torch.Tensor, batch_size: int,
                 chunk: int) -> None:
        self.ring, self.chunk = ring, chunk
        self.row_pos = row_pos  # [N] global position of each chain row, sorted by (row, position)
        self.row_counts = torch.bincount(row_batch, minlength=batch_size).tolist()
        self.k0 = self.v0 = None  # [B, kv_heads, n, d] this rank's block
        self.diag_k: list[torch.Tensor] = []  # each [1, kv_heads, N, d]
        self.diag_v: list[torch.Tensor] = []
        self.ring_outputs: list[torch.Tensor] = []  # every ring's outputs (joined into the loss)

    def _ring(self, q, q_pos, counts):
        out, lse = RingAttention.apply(q, self.k0, self.v0, q_pos, counts, self.ring, self.chunk,
                                       1.0 / math.sqrt(q.shape[-1]))
        self.ring_outputs += [out, lse]
        return out, lse

    def idle(self, head: Eagle3DraftHead, batch_size: int) -> None:
        """This rank's turn in a step's ring with no queries of its own (an empty shard at step 0, no chain rows
        later): the head cannot run on zero positions, and the neighbours still need the blocks passed on and
        the gradients brought home. Empty tensors are cut from a parameter so the ring stays in the graph."""
        c = head.cfg
        weight = head.midlayer.self_attn.k_proj.weight
        if self.k0 is None:
            self.k0 = self.v0 = weight.reshape(-1)[:0].reshape(batch_size, c.num_key_value_heads, 0, c.head_dim)
        q = weight.reshape(-1)[:0].reshape(c.num_attention_heads, 0, c.head_dim)
        self._ring(q, torch.zeros(0, dtype=torch.long, device=weight.device), [0] * batch_size)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n_rep = q.shape[1] // k.shape[1]
        if self.k0 is None:  # step 0: q [B, h, n, d]
            self.k0, self.v0 = k, v
            b, h, n, d = q.shape
            pos = self.ring.positions(self.ring.rank, q.device).repeat(b)
            out, _ = self._ring(q.transpose(0, 1).reshape(h, b * n, d), pos, [n] * b)
            return out.reshape(h, b, n, d).transpose(0, 1)
        self.diag_k.append(k)  # steps >= 1: q [1, h, N, d]
        self.diag_v.append(v)
        scale = 1.0 / math.sqrt(q.shape[-1])
        dk = torch.stack([repeat_kv(x, n_rep)[0] for x in self.diag_k], dim=-2)  # [h, N, j, d]
        dv = torch.stack([repeat_kv(x, n_rep)[0] for x in self.diag_v], dim=-2)
        diag = (q[0].unsqueeze(-2) * dk).sum(-1) * scale  # [h, N, j]
        prefix = self._ring(q[0], self.row_pos, self.row_counts)
        return merge(*prefix, *dense_partial(diag, dv))[0][None]


@dataclass(frozen=True)
class SeqParOutput:
    local_loss: torch.Tensor  # scalar: this rank's share (the shares sum to ttt_loss's loss, their gradients too)
    loss: float  # the whole batch's loss (every rank's share)
    ttt: TTTOutput  # step statistics of the whole batch; its loss is local_loss; row_* for this rank's chain rows

    def objective(self) -> torch.Tensor:
        """local_loss's gradient with the whole loss's value (what train_step reports)."""
        return self.local_loss + (self.loss - self.local_loss.detach())


def _check(head: Eagle3DraftHead, shard: SeqShard, ring: Ring, steps: int, attention_chunk: int) -> None:
    """Refuse what the ranks cannot compute exactly, before any exchange."""
    if head.cfg.num_experts > 1:
        raise ValueError(f"num_experts {head.cfg.num_experts}: sequence parallel needs a dense head (num_experts 1); "
                         "the router's load-balancing loss is not a sum over positions")
    if attention_chunk is None or attention_chunk < 1:
        raise ValueError(f"attention_chunk {attention_chunk} must be >= 1")
    if shard.halo < min(steps, shard.loss_mask.shape[1] - shard.end):
        raise ValueError(f"shard halo {shard.halo} must be >= steps {steps} (or reach the rows' end)")
    if ring.bounds != shard.bounds or ring.rank != shard.rank:
        raise ValueError(f"shard of rank {shard.rank} with bounds {shard.bounds} on ring rank {ring.rank} "
                         f"with bounds {ring.bounds}")


def _whole_batch(local: torch.Tensor, stats: torch.Tensor, ring: Ring, rows: torch.Tensor, start: int,
                 row_eligible: torch.Tensor, row_accepted: torch.Tensor) -> SeqParOutput:
    """Every rank's statistics summed (one all-reduce): stats [5, steps] = CE sum, correct, count, accept,
    eligible of this rank's rows."""
    steps = stats.shape[1]
    totals = torch.cat([stats.flatten(), local.detach().double().reshape(1)])
    dist.all_reduce(totals, group=ring.group)
    stats, loss = totals[:-1].view(5, steps), float(totals[-1])
    step_loss = [float(stats[0, j] / stats[2, j]) if stats[2, j] else 0.0 for j in range(steps)]
    correct, count, accept, eligible = ([int(x) for x in stats[i].tolist()] for i in range(1, 5))
    ttt = TTTOutput(local, step_loss, correct, count, accept, eligible, rows[:, 1] + start, row_eligible,
                    row_accepted)
    return SeqParOutput(local, loss, ttt)


def seqpar_ttt_loss(
    head: Eagle3DraftHead,
    shard: SeqShard,
    ring: Ring,
    steps: int = DEFAULT_TTT_STEPS,
    decay: float = DEFAULT_STEP_DECAY,
    max_loss_rows: int | None = None,
    generator: torch.Generator | None = None,
    attention_chunk: int = DEFAULT_CHUNK,
) -> SeqParOutput:
    """trainer/ttt.py's `ttt_loss` over the whole batch, computed by the ranks of `ring` together, each on its
    `shard` (see the module docstring). Every rank must call it with the same arguments but its own shard; with
    `max_loss_rows` the generators must be in the same state on every rank."""
    _check(head, shard, ring, steps, attention_chunk)
    bsz = shard.loss_mask.shape[0]
    dev = shard.window.input_ids.device
    start, end = shard.start, shard.end
    valid_all = [step_valid_mask(shard.loss_mask, shard.lengths, j) for j in range(steps)]  # [B, T] each
    sel_all = chain_rows(valid_all, max_loss_rows, generator)  # the same draw on every rank
    counts = [int(valid_all[j][sel_all].sum()) for j in range(steps)]  # every rank's valid rows per step
    sel = sel_all[:, start:end]  # [B, n]
    valid = [x[:, start:end] for x in valid_all]
    rows = sel.nonzero()  # [N, 2] sorted by (row, local position)
    attend = RingTTTAttention(ring, rows[:, 0], rows[:, 1] + start, bsz, attention_chunk)
    n = end - start
    w = shard.window
    local = w.aux.new_zeros((), dtype=torch.float32)
    stats = torch.zeros(5, steps, dtype=torch.float64, device=dev)  # ce sum, correct, count, accept, eligible
    alive = torch.ones(rows.shape[0], dtype=torch.bool, device=dev)
    row_eligible = torch.zeros(steps, rows.shape[0], dtype=torch.bool, device=dev)
    row_accepted = torch.zeros_like(row_eligible)
    d2t_ids = head.draft_to_target
    hidden = None
    for j in range(steps):
        valid_rows = valid[j][sel]  # [N]
        if (n == 0 and j == 0) or (rows.shape[0] == 0 and j > 0):
            attend.idle(head, bsz)  # nothing of this rank's to run: only its turn in the ring
            continue
        if j == 0:
            positions = torch.arange(start, end, device=dev)[None].expand(bsz, n)
            out = head.step(shift_left(w.input_ids, 1)[:, :n], w.aux, positions, attend, logits_rows=sel & valid[0])
            hidden = out.hidden[sel][None]  # [1, N, H]
        else:
            tokens = shift_left(w.input_ids, j + 1)[:, :n][sel][None]  # [1, N]
            out = head.step(tokens, hidden, (rows[:, 1] + start + j)[None], attend, logits_rows=valid_rows[None])
            hidden = out.hidden
        m = int(valid_rows.sum())
        if m == 0:
            alive = alive & valid_rows
            continue
        target_rows = shift_left(w.row_index, j + 1, fill=-1)[:, :n][sel][valid_rows]  # [m]
        truth = None if w.target_argmax is None else shift_left(w.target_argmax, j + 1)[:, :n][sel][valid_rows]
        ce, hit, row_eligible[j], alive = score_step(out.logits, w.target_probs[target_rows], truth, d2t_ids,
                                                     valid_rows, alive)  # ce: a mean over this rank's m rows
        row_accepted[j] = alive
        local = local + (decay**j) * ce * (m / counts[j])
        stats[:, j] = torch.tensor([float(ce.detach()) * m, int(hit.sum()), m, int(alive.sum()),
                                    int(row_eligible[j].sum())], dtype=torch.float64)
    local = _Join.apply(local, *attend.ring_outputs)
    return _whole_batch(local, stats, ring, rows, start, row_eligible, row_accepted)


def sequence_parallel_step(target, head: Eagle3DraftHead, optimizer: torch.optim.Optimizer, rows, step: int,
                           cfg: StepConfig, *, group: dist.ProcessGroup | None = None,
                           device: torch.device | str | None = None) -> tuple[StepStats, int]:
    """One optimizer step of `head` on traffic `rows`, this rank training its position shard of every row:
    (stats, rows regenerated here). Every rank of `group` calls it with the same rows, step and config; after
    it every rank holds the same head. stats: the whole batch's loss and step statistics, tokens this rank's
    owned real tokens (the ranks' tokens sum to the batch's). Chains sampled under cfg.max_loss_rows are drawn
    from a generator seeded by `step`, the same on every rank."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    shard, regenerated = shard_rows(target, head, rows, rank, world, halo=cfg.ttt_steps, device=device)
    ring = Ring(shard.bounds, group)
    generator = torch.Generator().manual_seed(step) if cfg.max_loss_rows is not None else None

    def objective(_window: TTTBatch):
        out = seqpar_ttt_loss(head, shard, ring, steps=cfg.ttt_steps, decay=cfg.step_decay,
                              max_loss_rows=cfg.max_loss_rows, generator=generator)
        return out.objective(), out.ttt

    stats = train_step(head, shard.window, optimizer, None, cfg, step=step, objective=objective,
                       reduce_gradients=lambda params: all_reduce_gradients(params, group))
    return stats, regenerated


def all_reduce_gradients(params: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
    """Sum every parameter's gradient over the group, in one flat all-reduce. A parameter with no gradient on
    some ranks counts as zero there; one with no gradient on any rank keeps none (as in one process)."""
    params = list(params)
    if not params:
        return
    like = params[0]
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(torch.float64
                      if like.dtype == torch.float64 else torch.float32) for p in params]
                     + [torch.tensor([float(p.grad is not None) for p in params], device=like.device,
                                     dtype=torch.float64 if like.dtype == torch.float64 else torch.float32)])
    dist.all_reduce(flat, group=group)
    offset = 0
    present = flat[-len(params):]
    for i, p in enumerate(params):
        g = flat[offset : offset + p.numel()].view_as(p).to(p.dtype)
        offset += p.numel()
        p.grad = g.clone() if float(present[i]) > 0 else None


__all__ = ["Ring", "RingAttention", "RingTTTAttention", "SeqParOutput", "SeqShard", "all_reduce_gradients",
           "seqpar_ttt_loss", "sequence_parallel_step", "shard_batch", "shard_rows", "split_positions"]
