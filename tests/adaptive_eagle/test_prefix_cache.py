"""The prefix cache: a session's later turn prefills only its new tokens, with the bits a fresh prefill computes
(prompts are prefilled in fixed blocks at absolute positions, so a cached block is the same forward of the same
inputs), bounded by bytes and evicted least recently used from a chain's end."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from adaptive_eagle.engine import EngineConfig, SpeculativeEngine
from adaptive_eagle.prefix_cache import CachedBlock, PrefixCache
from adaptive_eagle.targets import tiny_target
from adaptive_eagle.trace import SamplingParams
from tests.adaptive_eagle.test_engine import tiny_setup

BLOCK = 16


def _prefill(engine: SpeculativeEngine, ids: list[int], aux: bool = True, final: bool = True):
    cache = DynamicCache()
    with torch.inference_mode():
        logits, a, f = engine._prefill_blocks(ids, cache, aux, final)
    return logits, a, f, cache


def _same(x, y) -> bool:
    return x is None and y is None or torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cached_prefix_prefills_the_bits_a_fresh_prefill_computes(dtype):
    """Any dtype: the guarantee is by construction (the same block forwards), not by exact arithmetic."""
    target = tiny_target(seed=5, dtype=dtype, vocab_size=64, num_layers=4)
    cfg = EngineConfig(prefill_block=BLOCK, prompt_lookup=False, suffix_drafting=False, calibration_dir="")
    warm, cold = SpeculativeEngine(target, None, cfg), SpeculativeEngine(target, None, cfg)
    g = torch.Generator().manual_seed(0)
    turn1 = torch.randint(3, 64, (50,), generator=g).tolist()
    turn2 = turn1 + torch.randint(3, 64, (37,), generator=g).tolist()  # a later turn: the history + new tokens
    _prefill(warm, turn1)
    assert warm.prefix_cache.counts.stored_blocks == 3 and warm.prefix_cache.counts.hit_tokens == 0
    got, want = _prefill(warm, turn2), _prefill(cold, turn2)
    assert warm.prefix_cache.counts.hit_tokens == 48 and warm.prefix_cache.counts.miss_tokens == 50 + 39
    for x, y in zip(got[:3], want[:3]):
        assert _same(x, y)
    for a, b in zip(got[3].layers, want[3].layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    # the same prompt again: every whole block but the one holding the last token comes from the cache
    again = _prefill(warm, turn2)
    assert warm.prefix_cache.counts.hit_tokens == 48 + 80 and all(_same(x, y) for x, y in zip(again[:3], want[:3]))


def test_a_session_decodes_the_same_tokens_with_and_without_the_cache():
    target, head = tiny_setup(seed=2, dtype=torch.float32)
    base = dict(depth=4, topk=4, num_draft_tokens=12, cost_aware=False, prefill_block=BLOCK, calibration_dir="")
    cached = SpeculativeEngine(target, head, EngineConfig(**base))
    fresh = SpeculativeEngine(target, head, EngineConfig(**base, prefix_cache_mb=0))
    g = torch.Generator().manual_seed(1)
    history: list[int] = []
    sp = SamplingParams(temperature=0, max_tokens=12)
    for turn in range(4):
        history += torch.randint(3, 32, (int(torch.randint(5, 30, (1,), generator=g)),), generator=g).tolist()
        a = cached.generate(history, sp, capture=True)
        b = fresh.generate(history, sp, capture=True)
        assert a.token_ids == b.token_ids, turn
        assert (a.trace.aux_hidden == b.trace.aux_hidden).all() and (a.trace.final_hidden == b.trace.final_hidden).all()
        history += a.token_ids
    counts = cached.prefix_cache.counts
    assert counts.hits == 3 and counts.hit_tokens > 0 and fresh.prefix_cache.counts.stored_blocks == 0


def _block(nbytes_each: int = 64, aux: bool = True) -> CachedBlock:
    n = nbytes_each // 4
    t = torch.zeros(n)
    return CachedBlock((t,), (t,), t if aux else None, None)


def test_the_budget_evicts_least_recently_used_blocks_from_a_chains_end():
    pc = PrefixCache(block=2, max_bytes=4 * 192)  # room for 4 blocks of 192 bytes (keys, values, aux)
    a = pc.keys([1, 2, 3, 4, 5, 6])  # three blocks of one prefix
    b = pc.keys([9, 9, 8, 8])
    assert len(a) == 3 and a[:2] == pc.keys([1, 2, 3, 4]) and a[0] != b[0]
    for k in a:
        pc.store(k, _block())
    assert len(pc.lookup(a, need_aux=True, need_final=False)) == 3  # touched: a[2], a[1], a[0] (most recent)
    for k in b:
        pc.store(k, _block())
    assert len(pc) == 4 and pc.counts.evicted_blocks == 1 and pc.nbytes == 4 * 192
    assert len(pc.lookup(a, True, False)) == 2  # the chain's end went first; its start still matches
    assert len(pc.lookup(b, True, False)) == 2
    assert pc.lookup(a, True, need_final=True) == []  # a request that captures needs final rows too
    pc.store(pc.keys([7] * 20)[0], _block(nbytes_each=4096))
    assert pc.counts.refused_blocks == 1 and len(pc) == 4  # larger than the whole budget: refused, nothing evicted


def test_a_block_without_features_does_not_serve_a_request_that_needs_them():
    pc = PrefixCache(block=2, max_bytes=10_000)
    k = pc.keys([1, 2, 3, 4])
    pc.store(k[0], _block(aux=False))
    pc.store(k[1], _block())
    assert pc.lookup(k, need_aux=True, need_final=False) == []
    assert len(pc.lookup(k, need_aux=False, need_final=False)) == 2
    pc.store(k[0], _block())  # a prefill that computed them replaces the block
    assert len(pc.lookup(k, need_aux=True, need_final=False)) == 2


def test_settings_are_checked():
    with pytest.raises(ValueError, match="prefill_block must be >= 1"):
        EngineConfig(prefill_block=0)
    with pytest.raises(ValueError, match="prefix_cache_mb must be >= 0"):
        EngineConfig(prefix_cache_mb=-1)
    with pytest.raises(ValueError, match="budget must be >= 0"):
        PrefixCache(block=4, max_bytes=-1)
    off = PrefixCache(block=4, max_bytes=0)
    off.store(off.keys([1, 2, 3, 4])[0], _block())
    assert len(off) == 0


def test_a_faster_prefill_model_starts_plain_and_speculative_decoding_from_the_same_bits():
    """Target.prefill_model (bf16 where fp16-packed weights decode fastest): prompts prefill there, the decode
    cache gets its keys and values in the target's dtype, a cached prefix gives the same bits, and speculative
    greedy output is plain greedy output of the same target token for token."""
    import dataclasses

    target, head = tiny_setup(seed=2, dtype=torch.float32)
    fast = tiny_target(seed=2, dtype=torch.bfloat16, vocab_size=32, num_layers=6, initializer_range=0.15).model
    target = dataclasses.replace(target, prefill_model=fast)
    cfg = EngineConfig(depth=4, topk=4, num_draft_tokens=12, cost_aware=False, prefill_block=BLOCK,
                       calibration_dir="")
    spec, plain = SpeculativeEngine(target, head, cfg), SpeculativeEngine(target, None, cfg)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 32, (n,), generator=g).tolist() for n in (20, 41, 57)]
    sp = SamplingParams(temperature=0, max_tokens=16)
    for ids in prompts:
        assert spec.generate(ids, sp).token_ids == plain.generate(ids, sp).token_ids
    # the same prompt again (plain decoding keeps no features): two blocks from the cache
    logits, _, _, cache = _prefill(plain, prompts[1], aux=False, final=False)
    cold = _prefill(SpeculativeEngine(target, None, cfg), prompts[1], aux=False, final=False)
    assert plain.prefix_cache.counts.hit_tokens == 2 * BLOCK and cache.layers[0].keys.dtype == torch.float32
    assert torch.equal(logits, cold[0])
    for a, b in zip(cache.layers, cold[3].layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    with torch.inference_mode():  # the bf16 forward's keys, cast: not the fp32 model's own
        ref = DynamicCache()
        fast(input_ids=torch.tensor([prompts[1][:BLOCK]]), past_key_values=ref, use_cache=True)
    assert torch.equal(cache.layers[0].keys[..., :BLOCK, :], ref.layers[0].keys.float())


def test_where_prompts_prefill_in_bf16_a_packed_head_reads_them_with_a_bf16_copy_and_stays_exact():
    """fp16-packed decoding with bf16 prefill: the binding carries a bf16 copy of the head that reads prompts
    (binding.prompt_head, reading the prefill model's embedding); the drafting head stays packed fp32; greedy
    speculative output is plain greedy output token for token; without a prefill model there is no copy."""
    import dataclasses

    from adaptive_eagle.cpu_linear import Fp16PackedLinear

    base, head = tiny_setup(seed=5, dtype=torch.float32)
    fast = tiny_target(seed=5, dtype=torch.bfloat16, vocab_size=32, num_layers=6, initializer_range=0.15).model
    target = dataclasses.replace(base, prefill_model=fast, compute="float32+fp16-weights")
    cfg = EngineConfig(depth=4, topk=4, num_draft_tokens=12, cost_aware=False, prefill_block=BLOCK,
                       calibration_dir="", prompt_lookup=False, suffix_drafting=False)
    spec, plain = SpeculativeEngine(target, head, cfg), SpeculativeEngine(target, None, cfg)
    b = spec.binding
    assert b.prompt_head is not None and b.prompt_head.dtype == torch.bfloat16 and b.head.dtype == torch.float32
    assert isinstance(b.head.fc, Fp16PackedLinear) and isinstance(b.prompt_head.fc, torch.nn.Linear)
    assert b.prompt_head.embed_tokens.weight.data_ptr() == fast.get_input_embeddings().weight.data_ptr()
    assert b.head.embed_tokens.weight.data_ptr() == target.input_embeddings().data_ptr()
    g = torch.Generator().manual_seed(4)
    sp = SamplingParams(temperature=0, max_tokens=16)
    accepts = []
    for n in (20, 41, 57):
        ids = torch.randint(3, 32, (n,), generator=g).tolist()
        res = spec.generate(ids, sp)
        assert res.token_ids == plain.generate(ids, sp).token_ids
        accepts.append(res.accept_length_mean)
    assert max(accepts) > 1.0  # the head drafted, from the cache the bf16 copy filled
    assert SpeculativeEngine(base, head, cfg).binding.prompt_head is None


def test_a_prefill_runs_the_lm_head_once_on_its_last_row_as_a_matrix():
    """The blocks before the prompt's last compute no logits, and the last block's LM head gets its last row as a
    [1, H] matrix: the [1, 1, H] view HF's logits_to_keep hands it makes CPU kernels copy the whole transposed
    weight at every call (46 ms for SmolLM2 in bf16). The logits are the full forward's last row."""
    target = tiny_target(seed=5, dtype=torch.float32, vocab_size=64, num_layers=4)
    cfg = EngineConfig(prefill_block=BLOCK, prompt_lookup=False, suffix_drafting=False, calibration_dir="",
                       prefix_cache_mb=0)
    engine = SpeculativeEngine(target, None, cfg)
    calls = []
    hook = target.model.get_output_embeddings().register_forward_hook(lambda m, args, out: calls.append(args[0].shape))
    ids = torch.randint(3, 64, (3 * BLOCK + 5,), generator=torch.Generator().manual_seed(0)).tolist()
    try:
        logits, _, _, _ = _prefill(engine, ids, aux=True, final=False)
    finally:
        hook.remove()
    assert calls == [torch.Size([1, target.config.hidden_size])]
    with torch.inference_mode():
        full = target.model(input_ids=torch.tensor([ids])).logits[0, -1:]
    assert logits.shape == (1, 64) and torch.allclose(logits, full, atol=1e-5)
    engine._split_head = False  # an architecture outside SPLIT_HEAD_TYPES: the whole model, logits_to_keep=1
    other, _, _, _ = _prefill(engine, ids, aux=True, final=False)
    assert other.shape == (1, 64) and torch.allclose(other, full, atol=1e-5)
