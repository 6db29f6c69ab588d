"""Attention over long prefixes in bounded memory: key blocks merged by a running log-sum-exp.

Owns: `block_attention` (queries against one block of keys, causal by position, returning the
output AND its log-sum-exp, with a backward that recomputes the scores chunk by chunk instead of
saving them) and `merge` (two partial attentions over disjoint key sets combined exactly). These are
the two pieces that TTT on long records (trainer/ttt.py, `attention="chunked"`) and sequence-parallel
TTT (trainer/seqpar.py, a ring of key blocks over workers) are built from. Must not touch: the head,
the TTT pattern itself (which keys a row may see is the caller's `q_pos`/`k_pos`).

Memory. A dense softmax over a [T, T] score matrix keeps O(T^2) numbers for the backward. Here the
forward walks the keys `chunk` at a time keeping a running max, sum and output per query
(O(T · chunk) transient), saves only q, k, v, the output and the log-sum-exp (O(T)), and the
backward recomputes each chunk's probabilities from the saved log-sum-exp (the FlashAttention
recurrence, written with plain tensor ops). Peak memory grows linearly with T.

Exactness. For disjoint key sets A and B, softmax attention over A ∪ B equals
  out = out_A · exp(lse_A − lse) + out_B · exp(lse_B − lse),  lse = logaddexp(lse_A, lse_B),
so a row's prefix (any number of key blocks, local or received from other workers) and its own TTT
chain (the diagonal keys) are merged with no approximation.

Shapes: q [h, N, d]; k, v [kv_heads, S, d] (grouped-query: h a multiple of kv_heads, never
materialised repeated); q_pos [N] and k_pos [S] integer positions; key s is visible to query n iff
k_pos[s] <= q_pos[n]. A query with no visible key gets output 0 and log-sum-exp -inf.
"""

from __future__ import annotations

import math

import torch

DEFAULT_CHUNK = 1024


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics in float32 at least (float64 stays float64, for exactness tests)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grouped(q: torch.Tensor, kv_heads: int, q_pos: torch.Tensor):
    """[h, N, d] -> [kv_heads, rep * N, d] (query heads sharing a kv head stacked) and their positions."""
    h, n, d = q.shape
    rep = h // kv_heads
    return q.reshape(kv_heads, rep * n, d), q_pos.repeat(rep)


class BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_pos, k_pos, scale, chunk):
        h, n, d = q.shape
        kvh, s = k.shape[0], k.shape[1]
        cd = _compute_dtype(q.dtype)
        qg, qp = _grouped(q.to(cd), kvh, q_pos)
        m = torch.full(qg.shape[:2], float("-inf"), dtype=cd, device=q.device)  # running max
        l = torch.zeros(qg.shape[:2], dtype=cd, device=q.device)  # running sum of exp(score - m)
        acc = torch.zeros(qg.shape[0], qg.shape[1], v.shape[-1], dtype=cd, device=q.device)
        for c0 in range(0, s, chunk):
            kc, vc, kp = k[:, c0 : c0 + chunk].to(cd), v[:, c0 : c0 + chunk].to(cd), k_pos[c0 : c0 + chunk]
            if int(kp.min()) > int(qp.max()):
                continue  # nothing in this chunk is visible to any query
            sc = torch.matmul(qg, kc.transpose(-1, -2)).mul_(scale)
            sc.masked_fill_(kp[None, None, :] > qp[None, :, None], float("-inf"))
            m_new = torch.maximum(m, sc.amax(-1))
            safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(sc.sub_(safe[..., None]))
            corr = torch.exp(m - safe)
            l = l * corr + p.sum(-1)
            acc = acc * corr[..., None] + torch.matmul(p, vc)
            m = m_new
        seen = l > 0
        out = torch.where(seen[..., None], acc / torch.where(seen, l, torch.ones_like(l))[..., None], torch.zeros_like(acc))
        lse = torch.where(seen, m + torch.log(torch.where(seen, l, torch.ones_like(l))), torch.full_like(l, float("-inf")))
        ctx.save_for_backward(q, k, v, q_pos, k_pos, out, lse)
        ctx.scale, ctx.chunk = scale, chunk
        out_h = out.reshape(h, n, -1).to(q.dtype)
        return out_h, lse.reshape(h, n)

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, q_pos, k_pos, out, lse = ctx.saved_tensors
        h, n = q.shape[:2]
        grads = block_attention_grads(q, k, v, q_pos, k_pos, out.reshape(h, n, -1), lse.reshape(h, n), d_out, d_lse,
                                      ctx.scale, ctx.chunk)
        return (*grads, None, None, None, None)


def block_attention_grads(q, k, v, q_pos, k_pos, out, lse, d_out, d_lse, scale: float, chunk: int = DEFAULT_CHUNK):
    """(dq, dk, dv) of q's attention over this key block, recomputed chunk by chunk. `out` [h, N, d] and `lse`
    [h, N] (compute dtype) are those of the whole attention the block is part of: the block alone (this module's
    backward), or the merge of several blocks (a ring's, trainer/seqpar.py), whose gradient is the sum of every
    block's share computed this way. d_out, d_lse: the gradients of out and lse (None: zero)."""
    h, n, d = q.shape
    kvh, s = k.shape[0], k.shape[1]
    cd = out.dtype
    qg, qp = _grouped(q.to(cd), kvh, q_pos)
    og, lse = out.reshape(kvh, -1, out.shape[-1]), lse.reshape(kvh, -1)
    do = d_out.to(cd).reshape(kvh, -1, d_out.shape[-1]) if d_out is not None else torch.zeros_like(og)
    dl = d_lse.to(cd).reshape(kvh, -1) if d_lse is not None else torch.zeros_like(lse)
    seen = torch.isfinite(lse)
    lse_safe = torch.where(seen, lse, torch.zeros_like(lse))
    delta = (do * og).sum(-1) - dl  # D_i - dlse_i: ds = p * (dp - delta)
    dq = torch.zeros_like(qg)
    dk = torch.zeros(k.shape, dtype=cd, device=k.device)
    dv = torch.zeros(v.shape, dtype=cd, device=v.device)
    for c0 in range(0, s, chunk):
        kc, vc, kp = k[:, c0 : c0 + chunk].to(cd), v[:, c0 : c0 + chunk].to(cd), k_pos[c0 : c0 + chunk]
        if int(kp.min()) > int(qp.max()):
            continue
        sc = torch.matmul(qg, kc.transpose(-1, -2)).mul_(scale)
        hidden = (kp[None, None, :] > qp[None, :, None]) | ~seen[..., None]
        p = torch.exp(sc.sub_(lse_safe[..., None])).masked_fill_(hidden, 0.0)
        dv[:, c0 : c0 + chunk] = torch.matmul(p.transpose(-1, -2), do)
        ds = p.mul_(torch.matmul(do, vc.transpose(-1, -2)).sub_(delta[..., None])).mul_(scale)
        dq += torch.matmul(ds, kc)
        dk[:, c0 : c0 + chunk] = torch.matmul(ds.transpose(-1, -2), qg)
    return dq.reshape(h, n, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                    chunk: int = DEFAULT_CHUNK, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [h, N, d] in q's dtype, lse [h, N] in float32/float64) of q over the visible keys of this block."""
    if q.shape[0] % k.shape[0]:
        raise ValueError(f"query heads {q.shape[0]} must be a multiple of kv heads {k.shape[0]}")
    if chunk < 1:
        raise ValueError(f"chunk {chunk} must be >= 1")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return BlockAttention.apply(q, k, v, q_pos, k_pos, scale, chunk)


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor):
    """Attention over the union of two disjoint key sets from the two partials (exact; -inf lse = no keys)."""
    lse = torch.logaddexp(lse_a, lse_b)
    finite = torch.isfinite(lse)
    ref = torch.where(finite, lse, torch.zeros_like(lse))
    wa = torch.where(torch.isfinite(lse_a), torch.exp(lse_a - ref), torch.zeros_like(lse_a))
    wb = torch.where(torch.isfinite(lse_b), torch.exp(lse_b - ref), torch.zeros_like(lse_b))
    out = out_a * wa[..., None].to(out_a.dtype) + out_b * wb[..., None].to(out_b.dtype)
    return out, lse


def dense_partial(scores: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(scores) @ values, logsumexp(scores)) for a small explicit score block (the TTT diagonal:
    scores [h, N, j], values [h, N, j, d]); float32 statistics, autograd as usual."""
    cd = _compute_dtype(scores.dtype)
    lse = torch.logsumexp(scores.to(cd), dim=-1)
    probs = torch.exp(scores.to(cd) - lse[..., None]).to(values.dtype)
    return (probs.unsqueeze(-1) * values).sum(-2), lse


__all__ = ["DEFAULT_CHUNK", "BlockAttention", "block_attention", "block_attention_grads", "dense_partial", "merge"]
