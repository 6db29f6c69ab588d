"""The draft head: SGLang checkpoint layout, step shapes and the fc rule, MoE routing, the draft
vocabulary buffers and the drafting KV cache."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptive_eagle.draft_head import (
    DenseMLP,
    DraftHeadConfig,
    DraftKVCache,
    Eagle3DraftHead,
    MoEMLP,
    causal_attend,
    continuation_mask,
    init_weights,
)

H, HEADS, KV_HEADS, HEAD_DIM, INTER, H_TARGET, DRAFT_VOCAB, VOCAB = 64, 4, 2, 16, 96, 48, 40, 120


def make_cfg(**kw) -> DraftHeadConfig:
    base = dict(
        hidden_size=H, target_hidden_size=H_TARGET, intermediate_size=INTER, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB,
        aux_layer_ids=(2, 4, 5),
    )
    base.update(kw)
    return DraftHeadConfig(**base)


def make_head(seed=0, dtype=torch.float32, **kw) -> Eagle3DraftHead:
    torch.manual_seed(seed)
    head = Eagle3DraftHead(make_cfg(**kw))
    init_weights(head, std=0.2)
    torch.nn.init.normal_(head.embed_tokens.weight, std=1.0)
    return head.to(dtype).eval()


# ---- checkpoint layout ----------------------------------------------------------------------------
# Checkpoint keys and shapes of SGLang's EAGLE-3 draft model, transcribed from
# sgl-project/sglang python/sglang/srt/models/llama_eagle3.py:
#   LlamaModel: embed_tokens (VocabParallelEmbedding [vocab, H]); fc = Linear(target_hidden_size * 3,
#   H, bias=getattr(config, "bias", False)); midlayer = LlamaDecoderLayer whose qkv_proj reads
#   2 * hidden_size, plus hidden_norm = RMSNorm(H); norm = RMSNorm(H).
#   LlamaForCausalLMEagle3: lm_head = ParallelLMHead(draft_vocab_size, H); load_weights maps the
#   checkpoint's unfused .q_proj/.k_proj/.v_proj onto qkv_proj and .gate_proj/.up_proj onto
#   gate_up_proj, reads d2t (hot_token_id = d2t + arange) and skips t2d; a name is tried as is,
#   then as "model." + name.
# and python/sglang/srt/models/llama.py (LlamaDecoderLayer: self_attn, mlp, input_layernorm,
# post_attention_layernorm; LlamaAttention: qkv_proj [(heads + 2 kv_heads) * head_dim], o_proj
# [H, heads * head_dim], no bias; LlamaMLP: gate_up_proj, down_proj, no bias).
SGLANG_EAGLE3_CHECKPOINT = {
    "embed_tokens.weight": (VOCAB, H),
    "fc.weight": (H, 3 * H_TARGET),
    "midlayer.input_layernorm.weight": (H,),
    "midlayer.hidden_norm.weight": (H,),
    "midlayer.self_attn.q_proj.weight": (HEADS * HEAD_DIM, 2 * H),
    "midlayer.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, 2 * H),
    "midlayer.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, 2 * H),
    "midlayer.self_attn.o_proj.weight": (H, HEADS * HEAD_DIM),
    "midlayer.post_attention_layernorm.weight": (H,),
    "midlayer.mlp.gate_proj.weight": (INTER, H),
    "midlayer.mlp.up_proj.weight": (INTER, H),
    "midlayer.mlp.down_proj.weight": (H, INTER),
    "norm.weight": (H,),
    "lm_head.weight": (DRAFT_VOCAB, H),
    "d2t": (DRAFT_VOCAB,),
    "t2d": (VOCAB,),
}


def test_state_dict_equals_sglang_checkpoint_layout():
    sd = Eagle3DraftHead(make_cfg()).state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == SGLANG_EAGLE3_CHECKPOINT
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    head = Eagle3DraftHead(make_cfg())
    assert head.fc.bias is None and head.lm_head.bias is None
    assert not head.embed_tokens.weight.requires_grad
    trainable = {n for n, p in head.named_parameters() if p.requires_grad}
    assert trainable == set(SGLANG_EAGLE3_CHECKPOINT) - {"embed_tokens.weight", "d2t", "t2d"}


def test_moe_head_parameter_names():
    head = Eagle3DraftHead(make_cfg(num_experts=4, num_experts_per_tok=2))
    shapes = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    per_expert = INTER // 4
    expected = {k: v for k, v in SGLANG_EAGLE3_CHECKPOINT.items() if ".mlp." not in k}
    expected["midlayer.mlp.router.weight"] = (4, H)
    for e in range(4):
        expected[f"midlayer.mlp.experts.{e}.gate_proj.weight"] = (per_expert, H)
        expected[f"midlayer.mlp.experts.{e}.up_proj.weight"] = (per_expert, H)
        expected[f"midlayer.mlp.experts.{e}.down_proj.weight"] = (H, per_expert)
    assert shapes == expected


# ---- one step ------------------------------------------------------------------------------------------
def test_step_shapes_and_fc_only_for_aux_features():
    head = make_head()
    b, t = 2, 7
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (b, t), generator=g)
    pos = torch.arange(t)[None].expand(b, t)
    calls = []
    handle = head.fc.register_forward_hook(lambda m, a, o: calls.append(a[0].shape))
    try:
        out = head.step(ids, torch.randn(b, t, 3 * H_TARGET, generator=g), pos, causal_attend)
        assert out.hidden.shape == (b, t, H) and out.logits.shape == (b, t, DRAFT_VOCAB)
        assert calls == [(b, t, 3 * H_TARGET)]
        assert float(out.aux_loss) == 0.0  # dense head
        again = head.step(ids, out.hidden, pos + 1, causal_attend)  # the head's own output: width H
        assert again.hidden.shape == (b, t, H) and again.logits.shape == (b, t, DRAFT_VOCAB)
        assert len(calls) == 1  # fc was skipped
    finally:
        handle.remove()
    rows = torch.zeros(b, t, dtype=torch.bool)
    rows[0, 2] = rows[1, 5] = True
    sel = head.step(ids, out.hidden, pos, causal_attend, logits_rows=rows)
    assert sel.logits.shape == (2, DRAFT_VOCAB)
    torch.testing.assert_close(sel.logits, head.logits(sel.hidden)[rows])
    assert head.step(ids, out.hidden, pos, causal_attend, logits_rows=False).logits is None


def test_step_output_is_pre_norm_and_logits_go_through_norm():
    head = make_head(seed=1)
    torch.nn.init.normal_(head.norm.weight, mean=1.0, std=0.3)
    ids = torch.randint(0, VOCAB, (1, 5))
    out = head.step(ids, torch.randn(1, 5, 3 * H_TARGET), torch.arange(5)[None], causal_attend)
    torch.testing.assert_close(out.logits, head.lm_head(head.norm(out.hidden)))
    assert not torch.allclose(out.logits, head.lm_head(out.hidden))


# ---- MoE ---------------------------------------------------------------------------------------------------
def test_moe_with_one_expert_equals_dense():
    torch.manual_seed(0)
    dense = DenseMLP(H, INTER)
    moe = MoEMLP(H, INTER, num_experts=1, top_k=1)
    moe.experts[0].load_state_dict(dense.state_dict())
    x = torch.randn(3, 5, H)
    with torch.no_grad():
        out, aux = moe(x)
        torch.testing.assert_close(out, dense(x), rtol=0, atol=1e-6)
    assert torch.isfinite(aux) and float(aux) == pytest.approx(1.0)


def test_moe_routes_each_token_to_exactly_top_k_experts():
    torch.manual_seed(1)
    e, k = 4, 2
    moe = MoEMLP(H, 16, num_experts=e, top_k=k)
    torch.nn.init.normal_(moe.router.weight, std=1.0)
    x = torch.randn(2, 9, H)
    flat = x.reshape(-1, H)
    seen = {}

    def record(i):
        return lambda m, a, o: seen.setdefault(i, []).append(a[0].detach().clone())

    handles = [ex.register_forward_hook(record(i)) for i, ex in enumerate(moe.experts)]
    try:
        out, aux = moe(x)
    finally:
        for h in handles:
            h.remove()
    probs = torch.softmax(moe.router(flat), dim=-1)
    top_w, top_e = probs.topk(k, dim=-1)
    # every token reached exactly its k chosen experts, each once
    for i in range(e):
        got = torch.cat(seen.get(i, [torch.empty(0, H)]))
        want = flat[(top_e == i).any(-1)]
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert sum(torch.cat(v).shape[0] for v in seen.values()) == flat.shape[0] * k
    # output = renormalised top-k mixture
    ref = torch.zeros_like(flat)
    for n in range(flat.shape[0]):
        w = top_w[n] / top_w[n].sum()
        for slot in range(k):
            ref[n] += w[slot] * moe.experts[int(top_e[n, slot])](flat[n : n + 1])[0]
    torch.testing.assert_close(out.reshape(-1, H), ref, rtol=1e-5, atol=1e-6)
    # Switch loss: E * sum_e (share of routed slots to e) * (mean router prob of e)
    frac = torch.bincount(top_e.reshape(-1), minlength=e).float() / top_e.numel()
    torch.testing.assert_close(aux, e * (frac * probs.mean(0)).sum())


def test_load_balancing_loss_is_one_for_a_uniform_router_and_larger_when_skewed():
    moe = MoEMLP(H, 16, num_experts=4, top_k=2).requires_grad_(False)
    torch.nn.init.zeros_(moe.router.weight)
    x = torch.randn(20, H)
    _, aux = moe(x)
    assert float(aux) == pytest.approx(1.0, abs=1e-6)
    moe.router.weight[0, 0] = 50.0  # every token (all features > 0) prefers expert 0
    x = torch.randn(20, H).abs() + 1.0
    _, skewed = moe(x)
    assert float(skewed) > 1.5


def test_moe_head_step_reports_a_router_loss():
    head = make_head(num_experts=4, num_experts_per_tok=2).requires_grad_(False)
    out = head.step(torch.randint(0, VOCAB, (2, 6)), torch.randn(2, 6, 3 * H_TARGET), torch.arange(6)[None].expand(2, 6),
                    causal_attend)
    assert out.hidden.shape == (2, 6, H) and out.logits.shape == (2, 6, DRAFT_VOCAB)
    assert out.aux_loss.shape == () and torch.isfinite(out.aux_loss) and float(out.aux_loss) > 0


# ---- draft vocabulary ------------------------------------------------------------------------------------------
def test_set_draft_vocab_buffers():
    head = Eagle3DraftHead(make_cfg())
    g = torch.Generator().manual_seed(3)
    ids = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
    head.set_draft_vocab(ids)
    assert torch.equal(torch.arange(DRAFT_VOCAB) + head.d2t, ids)
    assert torch.equal(head.draft_to_target, ids)
    assert int(head.t2d.sum()) == DRAFT_VOCAB
    assert torch.equal(head.t2d.nonzero().flatten(), ids)
    assert head.d2t.dtype == torch.int64 and head.t2d.dtype == torch.bool


def test_default_draft_vocab_is_the_first_ids():
    head = Eagle3DraftHead(make_cfg())
    assert torch.equal(head.draft_to_target, torch.arange(DRAFT_VOCAB))
    assert torch.equal(head.d2t, torch.zeros(DRAFT_VOCAB, dtype=torch.long))


@pytest.mark.parametrize("case", ["unsorted", "duplicate", "short", "long", "negative", "too_large"])
def test_set_draft_vocab_refuses_bad_ids(case):
    head = Eagle3DraftHead(make_cfg())
    good = torch.arange(DRAFT_VOCAB) * 2
    head.set_draft_vocab(good)
    bad = {
        "unsorted": good.flip(0),
        "duplicate": torch.cat([good[:1], good[:-1]]),
        "short": good[:-1],
        "long": torch.arange(DRAFT_VOCAB + 1),
        "negative": torch.arange(DRAFT_VOCAB) - 1,
        "too_large": torch.arange(DRAFT_VOCAB) + (VOCAB - DRAFT_VOCAB + 1),
    }[case]
    with pytest.raises(ValueError):
        head.set_draft_vocab(bad)
    assert torch.equal(head.draft_to_target, good)  # a refused vocab leaves the head as it was
    assert torch.equal(head.t2d.nonzero().flatten(), good)


# ---- drafting KV cache ---------------------------------------------------------------------------------------------
def test_cached_step_by_step_equals_one_causal_forward():
    head = make_head(seed=2, dtype=torch.float64)
    t, prefill = 11, 4
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, t), generator=g)
    hidden = torch.randn(2, t, 3 * H_TARGET, generator=g, dtype=torch.float64)
    pos = torch.arange(t)[None].expand(2, t)
    full = head.step(ids, hidden, pos, causal_attend)

    cache = DraftKVCache.empty(head.cfg, 2, capacity=3, dtype=torch.float64, device="cpu")  # forces growth
    outs = [head.step(ids[:, :prefill], hidden[:, :prefill], pos[:, :prefill], cache.attend_fn())]
    s = prefill
    for n in (1, 2, 1, 3):  # single tokens and small chunks
        outs.append(head.step(ids[:, s : s + n], hidden[:, s : s + n], pos[:, s : s + n], cache.attend_fn()))
        s += n
    assert s == t and cache.length == t and cache.keys.shape[2] >= t
    torch.testing.assert_close(torch.cat([o.hidden for o in outs], 1), full.hidden)
    torch.testing.assert_close(torch.cat([o.logits for o in outs], 1), full.logits)


def test_cache_keep_and_crop():
    cfg = make_cfg()
    cache = DraftKVCache.empty(cfg, 1, capacity=8, dtype=torch.float32, device="cpu")
    k = torch.randn(1, KV_HEADS, 6, HEAD_DIM)
    v = torch.randn(1, KV_HEADS, 6, HEAD_DIM)
    cache.append(k, v)
    index = torch.tensor([0, 1, 3, 5])
    cache.keep(index)
    assert cache.length == 4
    torch.testing.assert_close(cache.keys[:, :, :4], k[:, :, index], rtol=0, atol=0)
    torch.testing.assert_close(cache.values[:, :, :4], v[:, :, index], rtol=0, atol=0)
    cache.crop(2)
    assert cache.length == 2
    cache.crop(5)  # never lengthens
    assert cache.length == 2


def test_cache_grows_beyond_capacity_and_keeps_contents():
    cfg = make_cfg()
    cache = DraftKVCache.empty(cfg, 2, capacity=2, dtype=torch.float32, device="cpu")
    chunks = [torch.randn(2, KV_HEADS, n, HEAD_DIM) for n in (1, 3, 5)]
    for c in chunks:
        cache.append(c, -c)
    assert cache.length == 9 and cache.keys.shape[2] >= 9 and cache.values.shape == cache.keys.shape
    torch.testing.assert_close(cache.keys[:, :, :9], torch.cat(chunks, 2), rtol=0, atol=0)
    torch.testing.assert_close(cache.values[:, :, :9], -torch.cat(chunks, 2), rtol=0, atol=0)


@settings(max_examples=25, deadline=None)
@given(t_new=st.integers(1, 12), past=st.integers(0, 20))
def test_continuation_mask_visibility(t_new, past):
    total = past + t_new
    m = continuation_mask(t_new, total, torch.float32, "cpu")
    assert m.shape == (1, 1, t_new, total)
    i = torch.arange(t_new)[:, None]
    j = torch.arange(total)[None, :]
    visible = j <= total - t_new + i
    assert torch.equal(m[0, 0] == 0, visible)
    assert torch.equal(torch.isneginf(m[0, 0]), ~visible)
