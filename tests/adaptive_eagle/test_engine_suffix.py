"""Cross-request suffix drafting in the engine: lossless (greedy and sampling), it pays on repeated
outputs, and tenants stay apart when the index isolates them."""

import pytest
import torch

from adaptive_eagle.engine import EngineConfig, SpeculativeEngine
from adaptive_eagle.suffix_index import SuffixIndex, SuffixIndexConfig
from adaptive_eagle.trace import SamplingParams
from tests.adaptive_eagle.test_engine import exact_marginals, plain_greedy, tiny_setup

SUFFIX_ONLY = dict(prompt_lookup=False, suffix_drafting=True, cost_aware=False, num_draft_tokens=8)


def test_suffix_drafts_are_lossless_and_pay_on_repeated_outputs():
    target, head = tiny_setup(seed=8)
    for h in (None, head):
        engine = SpeculativeEngine(target, h, EngineConfig(depth=3, topk=2, **SUFFIX_ONLY))
        engine.eos_ids = set()
        sp = SamplingParams(max_tokens=32)
        prompts = [[5, 6, 7], [9, 10, 11], [5, 6, 7]]
        results = [engine.generate(p, sp) for p in prompts]
        for p, r in zip(prompts, results):
            assert r.token_ids == plain_greedy(target, p, 32)
        # the third request repeats the first one's output: the index drafts it and the target accepts
        assert results[2].accept_length_mean > results[0].accept_length_mean + 1.0
        assert engine.suffix_index.documents == 3


def test_tenants_do_not_see_each_others_outputs_when_isolated():
    target, _ = tiny_setup(seed=9)
    index = SuffixIndex(SuffixIndexConfig(tenant_isolation=True))
    engine = SpeculativeEngine(target, None, EngineConfig(**SUFFIX_ONLY), suffix_index=index)
    engine.eos_ids = set()
    sp = SamplingParams(max_tokens=24)
    first = engine.generate([4, 5, 6], sp, tenant="a")
    other = engine.generate([4, 5, 6], sp, tenant="b")
    again = engine.generate([4, 5, 6], sp, tenant="a")
    assert first.token_ids == other.token_ids == again.token_ids
    assert all(s.tree_size == 0 for s in other.steps)  # nothing of tenant a's was offered to b
    assert sum(s.accept_length for s in again.steps) >= 12
    shared = SpeculativeEngine(target, None, EngineConfig(**SUFFIX_ONLY),
                               suffix_index=SuffixIndex(SuffixIndexConfig(tenant_isolation=False)))
    shared.eos_ids = set()
    shared.generate([4, 5, 6], sp, tenant="a")
    assert sum(s.accept_length for s in shared.generate([4, 5, 6], sp, tenant="b").steps) >= 12


def test_a_request_that_opts_out_never_feeds_the_index():
    target, _ = tiny_setup(seed=10)
    engine = SpeculativeEngine(target, None, EngineConfig(**SUFFIX_ONLY))
    engine.eos_ids = set()
    engine.generate([4, 5, 6], SamplingParams(max_tokens=16), index_output=False)
    assert engine.suffix_index.documents == 0
    engine.generate([4, 5, 6], SamplingParams(max_tokens=16))
    assert engine.suffix_index.documents == 1


@pytest.mark.slow
def test_sampling_with_suffix_drafts_keeps_the_target_distribution():
    """Marginals of the 2nd and 3rd sampled tokens, drawn with only suffix-index drafts (plain target,
    no head), match the target's exact marginals (chi-square p > 1e-3 on 1,500 draws)."""
    from scipy import stats

    target, _ = tiny_setup(seed=5, vocab=8)
    engine = SpeculativeEngine(target, None, EngineConfig(**{**SUFFIX_ONLY, "num_draft_tokens": 6}),
                               suffix_index=SuffixIndex(SuffixIndexConfig(min_match=1)))
    engine.eos_ids = set()
    prompt = [3, 4]

    p2, p3 = exact_marginals(target, prompt, 8)
    g = torch.Generator().manual_seed(1)
    n = 1500
    c2, c3 = torch.zeros(8), torch.zeros(8)
    drafted = accepted = 0
    for _ in range(n):
        res = engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=3), generator=g)
        c2[res.token_ids[1]] += 1
        c3[res.token_ids[2]] += 1
        drafted += sum(s.tree_size > 0 for s in res.steps)
        accepted += sum(s.accept_length for s in res.steps)
    assert drafted > n // 2 and accepted > n // 10  # suffix drafts were offered and taken
    for counts, p in ((c2, p2), (c3, p3)):
        assert stats.chisquare(counts.numpy(), (p * n).numpy()).pvalue > 1e-3
