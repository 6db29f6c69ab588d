"""The engine is lossless: greedy speculative output == plain greedy output, token for token."""

import os

import pytest
import torch

from adaptive_eagle.costmodel import PinnedCosts
from adaptive_eagle.draft_head import DraftHeadConfig, Eagle3DraftHead, init_weights
from adaptive_eagle.engine import EngineConfig, GenerationError, GenerationRequest, SpeculativeEngine
from adaptive_eagle.stopping import cut_at_stop
from adaptive_eagle.targets import tiny_target
from adaptive_eagle.trace import SamplingParams


DEVICE = os.environ.get("ADAPTIVE_EAGLE_TEST_DEVICE", "cpu")  # bench/gpu_check.sh sets cuda
# Tests that assert on drafting (acceptance, observations, tree sizes) pin the cost-aware engine's costs:
# measured timings make those decisions depend on the machine and its load (a loaded CPU drafts less).
# A modest profile, so that pruning still happens: a 17-token verify costs 1.3x a one-token forward.
PINNED = PinnedCosts(verify_ms=((1, 10.0), (17, 13.0), (64, 30.0)), overhead_ms=2.0)


def tiny_setup(seed=0, vocab=32, dtype=torch.float64, draft_vocab=None):
    target = tiny_target(seed=seed, dtype=dtype, vocab_size=vocab, num_layers=6, initializer_range=0.15)
    target.model.to(DEVICE)
    cfg = DraftHeadConfig.from_target(target.config, draft_vocab_size=draft_vocab or vocab,
                                      aux_layer_ids=target.aux_layer_ids)
    torch.manual_seed(seed + 7)
    head = Eagle3DraftHead(cfg)
    init_weights(head, std=0.1)
    head.embed_tokens.weight.data.copy_(target.input_embeddings())
    if draft_vocab:
        head.set_draft_vocab(torch.randperm(vocab)[:draft_vocab].sort().values)
    return target, head.to(dtype).to(DEVICE)


def exact_marginals(target, prompt, vocab):
    """The target's exact marginals of the 2nd and 3rd sampled tokens after `prompt` (enumerated)."""
    def dist(ids):
        with torch.no_grad():
            return torch.softmax(target.model(torch.tensor([ids], device=target.device)).logits[0, -1].double(), -1).cpu()

    p1 = dist(prompt)
    p2 = torch.zeros(vocab, dtype=torch.float64)
    p3 = torch.zeros(vocab, dtype=torch.float64)
    for a in range(vocab):
        pa = dist(prompt + [a])
        p2 += p1[a] * pa
        for b in range(vocab):
            p3 += p1[a] * pa[b] * dist(prompt + [a, b])
    return p2, p3


def plain_greedy(target, prompt, n):
    ids = torch.tensor([prompt], device=target.device)
    with torch.no_grad():
        for _ in range(n):
            nxt = target.model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("cfg", [EngineConfig(depth=1, topk=1, num_draft_tokens=1, cost_aware=False),
                                 EngineConfig(depth=4, topk=1, num_draft_tokens=4, cost_aware=False),
                                 EngineConfig(depth=4, topk=4, num_draft_tokens=12, cost_aware=False),
                                 EngineConfig(depth=6, topk=8, num_draft_tokens=40, cost_aware=False),
                                 EngineConfig(depth=4, topk=4, num_draft_tokens=12, pinned_costs=PINNED)])
def test_greedy_equals_plain_greedy(cfg):
    target, head = tiny_setup()
    engine = SpeculativeEngine(target, head, cfg)
    plain = SpeculativeEngine(target, None, cfg)
    g = torch.Generator().manual_seed(0)
    accepted = 0
    for i in range(6):
        prompt = torch.randint(3, 32, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        want = plain_greedy(target, prompt, 24)
        sp = SamplingParams(temperature=0, max_tokens=24)
        res = engine.generate(prompt, sp)
        base = plain.generate(prompt, sp)
        cut = min(len(want), len(res.token_ids))
        assert res.token_ids[:cut] == want[:cut] and base.token_ids[:cut] == want[:cut]
        assert res.token_ids == base.token_ids
        accepted += sum(s.accept_length for s in res.steps)
    if cfg.topk > 1:
        assert accepted > 0  # multi-token acceptance paths were exercised


def test_reduced_draft_vocab_is_still_lossless():
    target, head = tiny_setup(seed=3, draft_vocab=20)
    engine = SpeculativeEngine(target, head, EngineConfig(depth=3, topk=4, num_draft_tokens=10, cost_aware=False))
    prompt = [5, 9, 3, 17]
    got = engine.generate(prompt, SamplingParams(max_tokens=20)).token_ids
    want = plain_greedy(target, prompt, 20)
    assert got == want[: len(got)]
    assert len(got) == 20 or got[-1] in engine.eos_ids  # stopped early only at EOS


def test_captured_hidden_states_equal_a_fresh_forward():
    target, head = tiny_setup(seed=1)
    engine = SpeculativeEngine(target, head, EngineConfig(depth=3, topk=4, num_draft_tokens=8, cost_aware=False))
    res = engine.generate([4, 8, 15, 16, 23], SamplingParams(max_tokens=16), capture=True)
    ids = torch.tensor([list(res.trace.input_ids)], device=target.device)
    fresh = target.features(ids).aux[0].cpu()
    got = torch.from_numpy(res.trace.aux_hidden)
    assert got.shape[0] == ids.shape[1] - 1
    torch.testing.assert_close(got, fresh[: got.shape[0]].float(), rtol=1e-5, atol=1e-5)


def test_kv_cache_after_acceptance_equals_plain_cache():
    from transformers import DynamicCache

    target, head = tiny_setup(seed=2)
    engine = SpeculativeEngine(target, head, EngineConfig(depth=4, topk=4, num_draft_tokens=12, cost_aware=False))
    captured = {}
    orig = engine._keep_cache

    def spy(cache, keep):
        orig(cache, keep)
        captured["cache"] = cache

    engine._keep_cache = spy
    res = engine.generate([3, 1, 4, 1, 5], SamplingParams(max_tokens=12))
    cache = captured["cache"]
    n_cached = cache.get_seq_length()
    ids = torch.tensor([list(res.trace.input_ids)[:n_cached]], device=target.device)
    ref = DynamicCache()
    with torch.no_grad():
        target.model(ids, past_key_values=ref, use_cache=True)
    for a, b in zip(cache.layers, ref.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(a.values, b.values, rtol=1e-6, atol=1e-8)


def test_trace_records_steps():
    target, head = tiny_setup()
    for cost_aware in (False, True):  # cost-aware steps may verify no draft at all (a plain step)
        engine = SpeculativeEngine(target, head, EngineConfig(cost_aware=cost_aware))
        res = engine.generate([7, 7, 7], SamplingParams(max_tokens=10))
        tr = res.trace
        assert tr.loss_mask.count(1) == len(res.token_ids) and tr.backend == "reference"
        assert all(s.tree_size >= (0 if cost_aware else 1) and 0 <= s.accept_length <= s.tree_size for s in tr.steps)
        assert sum(s.accept_length + 1 for s in tr.steps) + 1 >= len(res.token_ids)


def test_bad_inputs_are_refused():
    target, head = tiny_setup()
    engine = SpeculativeEngine(target, head)
    with pytest.raises(GenerationError, match="empty"):
        engine.generate([], SamplingParams())
    with pytest.raises(GenerationError, match="context"):
        engine.generate([3] * 1030, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    other, _ = tiny_setup(vocab=48)
    with pytest.raises(GenerationError, match="vocab"):
        SpeculativeEngine(other, head)


@pytest.mark.slow
def test_sampling_keeps_the_target_distribution():
    """Marginals of the 2nd and 3rd sampled tokens (both emitted through tree verification) match
    the target's exact marginals (enumerated), chi-square p > 1e-3 on 1,500 draws; a row offset or
    a wrong residual would shift them far more than that."""
    from scipy import stats

    target, head = tiny_setup(seed=5, vocab=8)
    engine = SpeculativeEngine(target, head, EngineConfig(depth=3, topk=3, num_draft_tokens=8, cost_aware=False))
    engine.eos_ids = set()  # tiny vocab: keep EOS as an ordinary token
    prompt = [3, 4]

    p2, p3 = exact_marginals(target, prompt, 8)
    g = torch.Generator().manual_seed(0)
    n = 1500
    c2, c3 = torch.zeros(8), torch.zeros(8)
    accepted = 0
    for _ in range(n):
        res = engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=3), generator=g)
        c2[res.token_ids[1]] += 1
        c3[res.token_ids[2]] += 1
        accepted += sum(s.accept_length for s in res.steps)
    assert accepted > n // 4  # the tree path was exercised
    for counts, p in ((c2, p2), (c3, p3)):
        assert stats.chisquare(counts.numpy(), (p * n).numpy()).pvalue > 1e-3


def test_prompt_lookup_stays_lossless_and_raises_accept_length_on_repetition():
    target, head = tiny_setup(seed=4)
    base_cfg = dict(depth=3, topk=2, num_draft_tokens=8, cost_aware=False)
    with_lookup = SpeculativeEngine(target, head, EngineConfig(**base_cfg, prompt_lookup=True))
    without = SpeculativeEngine(target, head, EngineConfig(**base_cfg, prompt_lookup=False))
    lookup_only = SpeculativeEngine(target, None, EngineConfig(**base_cfg, prompt_lookup=True))
    with_lookup.eos_ids = without.eos_ids = lookup_only.eos_ids = set()
    prompt = [5, 6, 7, 8, 9] * 3
    sp = SamplingParams(max_tokens=48)
    want = plain_greedy(target, prompt, 48)
    a, b, c = (e.generate(prompt, sp) for e in (with_lookup, without, lookup_only))
    assert a.token_ids == want and b.token_ids == want and c.token_ids == want
    # a random tiny model falls into a loop: the context repeats, lookup drafts get accepted
    assert a.accept_length_mean > b.accept_length_mean, (a.accept_length_mean, b.accept_length_mean)
    assert c.accept_length_mean > 1.05, (a.accept_length_mean, b.accept_length_mean, c.accept_length_mean)


def test_suffix_match_continuation():
    from adaptive_eagle.lookup import suffix_match_continuation

    ctx = [1, 2, 3, 4, 9, 9, 1, 2, 3]
    assert suffix_match_continuation(ctx, 3) == [4, 9, 9]
    assert suffix_match_continuation([1, 2, 3], 3) == []
    assert suffix_match_continuation(ctx, 0) == []


def test_cost_aware_engine_copying_from_context_is_lossless():
    target, head = tiny_setup(seed=4)
    engine = SpeculativeEngine(target, head, EngineConfig(depth=3, topk=2, num_draft_tokens=8, pinned_costs=PINNED))
    engine.calibration.lookup_hits, engine.calibration.lookup_tries = [50.0] * 8, [50.0] * 8  # lookup is "sure"
    engine.eos_ids = set()
    prompt = [5, 6, 7, 8, 9] * 3
    got = engine.generate(prompt, SamplingParams(max_tokens=48))
    assert got.token_ids == plain_greedy(target, prompt, 48)
    assert any(s.tree_size > 0 for s in got.steps)


def test_pinned_costs_make_drafting_independent_of_how_fast_the_target_runs():
    """The same requests on a target slowed by 20 ms a forward (a loaded machine) draft the same trees and
    accept the same tokens: with pinned costs nothing the engine decides depends on a clock. The engine
    times nothing either (no verify-cost table is measured at start)."""
    import functools
    import time

    def run(slow: bool):
        target, head = tiny_setup(seed=6)
        if slow:
            forward = target.model.forward

            @functools.wraps(forward)
            def slowed(*args, **kwargs):
                time.sleep(0.02)
                return forward(*args, **kwargs)

            target.model.forward = slowed
        engine = SpeculativeEngine(target, head, EngineConfig(depth=4, topk=3, num_draft_tokens=10, pinned_costs=PINNED,
                                                               calibration_dir=""))
        engine.eos_ids = set()
        assert engine.verify_cost.points == dict(PINNED.verify_ms)  # nothing measured
        steps = [engine.generate(p, SamplingParams(max_tokens=20)).steps for p in ([3, 5, 7], [9, 9, 2, 4], [5] * 6)]
        return steps, engine.binding.gate

    fast, slow = run(False), run(True)
    assert fast[0] == slow[0]
    assert (fast[1].draft_rate, fast[1].plain_rate) == (slow[1].draft_rate, slow[1].plain_rate)
    sizes = {s.tree_size for request in fast[0] for s in request}
    assert len(sizes) > 1  # pruning and the gate were at work (trees of several sizes), not a fixed tree
    with pytest.raises(ValueError, match="pinned_costs"):
        EngineConfig(pinned_costs=[(1, 2.0)])
    assert EngineConfig(pinned_costs={"verify_ms": [[1, 2.0]]}).pinned_costs == PinnedCosts(((1, 2.0),))


def test_stop_strings_and_max_tokens_end_the_output_where_plain_decoding_would():
    target, head = tiny_setup()
    cfg = EngineConfig(depth=4, topk=4, num_draft_tokens=12, cost_aware=False)
    engine, plain = SpeculativeEngine(target, head, cfg), SpeculativeEngine(target, None, cfg)
    prompt = [4, 8, 15, 16, 23]
    full = plain.generate(prompt, SamplingParams(max_tokens=24)).token_ids
    assert len(full) == 24
    for max_tokens in (3, 7, 11):  # a verify step that commits past max_tokens is cut there
        sp = SamplingParams(max_tokens=max_tokens)
        got, base = engine.generate(prompt, sp), plain.generate(prompt, sp)
        assert got.token_ids == base.token_ids and len(got.token_ids) <= max_tokens
    stop = (engine.detokenize(full[6:8]),)  # a tokenizer-less target's text: the ids joined by spaces
    ends = next(i for i in range(1, len(full) + 1)
                if cut_at_stop(engine.detokenize(full[:i]), stop) != engine.detokenize(full[:i]))
    request = GenerationRequest(prompt, SamplingParams(max_tokens=24), stop, request_id="r", domain="code")
    items = list(engine.run(request))
    res = items[-1]
    assert res.token_ids == full[:ends] and res.finish_reason == "stop"
    assert res.output_text == cut_at_stop(engine.detokenize(full[:ends]), stop)
    assert "".join(i.text for i in items[:-1]) == res.output_text  # shown as it became final, stop string never
    assert res.trace.domain == "code" and res.trace.request_id == "r"
    keywords = engine.generate(prompt, SamplingParams(max_tokens=24), stop=list(stop), request_id="r")
    assert keywords.token_ids == res.token_ids == plain.generate(request).token_ids
    with pytest.raises(TypeError):
        engine.generate(request, SamplingParams())


def test_a_request_that_speculation_slows_decodes_plainly_with_the_same_tokens(monkeypatch):
    """The engine follows the request's own gate (costmodel.PlainGate, whose decisions test_costmodel tables):
    steps it declines decode plainly (nothing drafted, counted as plain steps), the rest speculate, and the
    tokens are plain greedy's either way; the gate sees every step's tokens and time."""
    from adaptive_eagle.costmodel import PlainGate

    target, head = tiny_setup(seed=4)
    cfg = EngineConfig(depth=4, topk=4, num_draft_tokens=16, pinned_costs=PinnedCosts.flat(), prompt_lookup=False,
                       suffix_drafting=False, calibration_dir="")
    prompt = [5, 9, 3, 17, 4, 11]
    want = plain_greedy(target, prompt, 48)
    seen = []
    monkeypatch.setattr(PlainGate, "allow", lambda self, plain: len(seen) % 3 == 0)  # speculate every 3rd step
    monkeypatch.setattr(PlainGate, "observe", lambda self, spec, tokens, ms: seen.append((spec, tokens, ms)))
    engine = SpeculativeEngine(target, head, cfg)
    engine._head_pays = lambda state: True
    res = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=48))
    assert res.token_ids == want[: len(res.token_ids)] and len(res.token_ids) >= 30
    assert len(seen) == len(res.steps) and all(ms > 0 for _, _, ms in seen)
    sizes = [s.tree_size for s in res.steps]
    assert all((q == 0) == (i % 3 != 0) for i, q in enumerate(sizes))  # declined steps drafted nothing


def test_the_first_token_waits_for_the_target_alone_and_a_request_that_never_drafts_never_feeds_the_head(
        monkeypatch):
    """The head reads the prompt after the first token is out (engine._read_prompt), not before it; a request
    that ends at its first token never runs the head; greedy output is plain greedy output either way."""
    import adaptive_eagle.drafting as drafting

    target, head = tiny_setup(seed=4)
    engine = SpeculativeEngine(target, head, EngineConfig(depth=3, topk=2, num_draft_tokens=6, cost_aware=False,
                                                          prompt_lookup=False, suffix_drafting=False,
                                                          calibration_dir=""))
    engine.eos_ids = set()
    calls = []
    real = drafting.head_extend
    monkeypatch.setattr(drafting, "head_extend", lambda *a, **k: calls.append(len(a[2])) or real(*a, **k))
    prompt = [3, 9, 14, 2, 7, 7, 20, 11]
    stream = engine.stream(prompt, SamplingParams(max_tokens=12))
    first, _ = next(stream)
    assert len(first) == 1 and calls == []
    out = first + [t for toks, _ in stream for t in toks]
    assert calls[0] == len(prompt)  # the whole prompt (and the first token's position), in one chunk here
    assert out == plain_greedy(target, prompt, 12)
    calls.clear()
    assert engine.generate(prompt, SamplingParams(max_tokens=1)).token_ids == out[:1] and calls == []
