"""Chunked attention with a running log-sum-exp == dense softmax attention (float64: outputs,
log-sum-exps, gradients), and chunked TTT == dense TTT (loss and every parameter's gradient)."""

import math

import pytest
import torch

from tests.trainer.test_ttt import make_batch, make_setup
from trainer.long_attention import block_attention, dense_partial, merge
from trainer.ttt import ttt_loss


def dense_reference(q, k, v, q_pos, k_pos):
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ v, lse


def inputs(h=4, kvh=2, n=13, s=17, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(h, n, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(kvh, s, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(kvh, s, d, generator=g, dtype=torch.float64, requires_grad=True)
    q_pos = torch.randint(0, s, (n,), generator=g)
    return q, k, v, q_pos, torch.arange(s)


@pytest.mark.parametrize("chunk", [1, 4, 17, 64])
def test_block_attention_equals_dense_with_gradients(chunk):
    q, k, v, q_pos, k_pos = inputs()
    g = torch.Generator().manual_seed(1)
    w_out, w_lse = torch.randn(4, 13, 8, generator=g, dtype=torch.float64), torch.randn(4, 13, generator=g, dtype=torch.float64)

    def run(fn):
        out, lse = fn(q, k, v, q_pos, k_pos)
        loss = (out * w_out).sum() + (lse * w_lse).sum()  # the log-sum-exp carries gradient too (merges use it)
        grads = torch.autograd.grad(loss, (q, k, v))
        return out.detach(), lse.detach(), grads

    got = run(lambda *a: block_attention(*a, chunk=chunk))
    want = run(dense_reference)
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-12)
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_gradcheck():
    q, k, v, q_pos, k_pos = inputs(h=2, kvh=1, n=5, s=6, d=3)
    assert torch.autograd.gradcheck(lambda q, k, v: block_attention(q, k, v, q_pos, k_pos, chunk=4), (q, k, v))


def test_merge_of_disjoint_blocks_is_the_whole_and_empty_blocks_are_neutral():
    q, k, v, q_pos, k_pos = inputs()
    whole = dense_reference(q, k, v, q_pos, k_pos)
    a = block_attention(q, k[:, :7], v[:, :7], q_pos, k_pos[:7], chunk=3)
    b = block_attention(q, k[:, 7:], v[:, 7:], q_pos, k_pos[7:], chunk=3)
    out, lse = merge(*a, *b)
    torch.testing.assert_close(out, whole[0])
    torch.testing.assert_close(lse, whole[1])
    # a block with no visible key: output 0, lse -inf, and merging it changes nothing (no NaN)
    late = block_attention(q, k, v, q_pos, k_pos + 1000, chunk=5)
    assert torch.all(late[0] == 0) and torch.all(torch.isinf(late[1]))
    out2, lse2 = merge(out, lse, *late)
    torch.testing.assert_close(out2, out)
    (out2.sum() + lse2.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_dense_partial_is_softmax():
    g = torch.Generator().manual_seed(3)
    s, vals = torch.randn(2, 5, 3, generator=g, dtype=torch.float64), torch.randn(2, 5, 3, 4, generator=g, dtype=torch.float64)
    out, lse = dense_partial(s, vals)
    torch.testing.assert_close(out, (torch.softmax(s, -1)[..., None] * vals).sum(-2))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))


@pytest.mark.parametrize("chunk", [3, 7, 1024])
def test_chunked_ttt_equals_dense_loss_and_gradients(chunk):
    target, head = make_setup(dtype=torch.float64)
    batch = make_batch(target, head, b=3, t=24)
    params = [p for p in head.parameters() if p.requires_grad]

    def run(attention_chunk):
        out = ttt_loss(head, batch, steps=5, attention_chunk=attention_chunk)
        return out, torch.autograd.grad(out.loss, params, allow_unused=True)

    dense, g_dense = run(None)
    chunked, g_chunked = run(chunk)
    torch.testing.assert_close(chunked.loss, dense.loss, rtol=1e-12, atol=1e-12)
    assert chunked.step_accept == dense.step_accept and chunked.step_eligible == dense.step_eligible
    for p, a, b in zip(params, g_chunked, g_dense):
        if b is None:
            assert a is None
            continue
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
