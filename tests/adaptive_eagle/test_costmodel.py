"""Cost-aware tree sizing: the verify-cost model, acceptance calibration and the kept-node choice."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptive_eagle.costmodel import AcceptCalibration, VerifyCost, best_prefix, min_useful_prob


def test_verify_cost_interpolates_extrapolates_and_follows_observations():
    c = VerifyCost({1: 10.0, 5: 30.0, 9: 50.0})
    assert c(1) == 10.0 and c(3) == 20.0 and c(7) == 40.0
    assert c(13) == 70.0  # along the last segment
    c.observe(5, 40.0)
    assert 30.0 < c(5) < 40.0  # a moving average, not the last sample
    assert VerifyCost()(4) == 4.0  # unmeasured: proportional to size


def chain(n):
    return torch.arange(n) - 1, torch.arange(1, n + 1)


def test_best_prefix_keeps_everything_when_verifying_is_free_and_little_when_it_is_dear():
    parents, depths = chain(6)
    accept = torch.tensor([0.9, 0.8, 0.6, 0.3, 0.1, 0.05])
    flat = VerifyCost({1: 10.0, 64: 10.0})
    assert best_prefix(accept, parents, depths, flat, draft_ms=2.0) == [0, 1, 2, 3, 4, 5]
    steep = VerifyCost({1: 10.0, 2: 15.0, 64: 325.0})  # +5 ms per token: only nodes worth > 1/2 token
    kept = best_prefix(accept, parents, depths, steep, draft_ms=0.0)
    assert kept == [0, 1]  # 2.7/20 beats 1.9/15 and 3.3/25
    assert best_prefix(torch.tensor([0.01]), *chain(1), steep, 0.0) == []  # nothing pays: plain step


def test_a_child_is_never_valued_above_its_parent():
    # node 1 (child of 0) claims 0.9 but its parent only 0.2: keeping 1 alone would be unsound
    parents, depths = torch.tensor([-1, 0, -1]), torch.tensor([1, 2, 1])
    kept = best_prefix(torch.tensor([0.2, 0.9, 0.5]), parents, depths, VerifyCost({1: 10.0, 2: 12.0, 64: 136.0}), 0.0)
    assert kept == [2]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(-1, 30), st.floats(0, 1)), min_size=1, max_size=30),
       st.floats(0, 20), st.floats(0, 50))
def test_best_prefix_is_ancestor_closed_and_optimal(nodes, slope, draft_ms):
    parents = torch.tensor([p if p < i else -1 for i, (p, _) in enumerate(nodes)])  # parents come first
    depths = torch.zeros(len(nodes), dtype=torch.long)
    for i, p in enumerate(parents.tolist()):
        depths[i] = 1 if p < 0 else depths[p] + 1
    accept = torch.tensor([a for _, a in nodes])
    cost = VerifyCost({1: 10.0, 64: 10.0 + 63 * slope})
    kept = best_prefix(accept, parents, depths, cost, draft_ms)
    assert kept == sorted(set(kept))
    assert all(int(parents[i]) < 0 or int(parents[i]) in kept for i in kept)
    # no ancestor-closed set of any size beats it (checked against the chain of parent-capped values)
    val = accept.clone()
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            val[i] = min(val[i], val[p])
    rate = (1 + float(val[kept].sum())) / (draft_ms + cost(1 + len(kept)))
    best_any = max((1 + float(val.sort(descending=True).values[:k].sum())) / (draft_ms + cost(1 + k))
                   for k in range(len(nodes) + 1))
    assert rate >= best_any * (1 - 1e-6)


def test_calibration_learns_from_what_the_target_accepts():
    cal = AcceptCalibration()
    before = float(cal.eagle(torch.tensor([0.6]))[0])
    assert 0.5 < before < 0.7  # the draft's own probability until evidence arrives
    cal.observe_eagle([0.6] * 200, [False] * 200)  # an overconfident draft
    assert float(cal.eagle(torch.tensor([0.6]))[0]) < 0.05
    assert 0.4 < float(cal.eagle(torch.tensor([0.45]))[0]) < 0.5  # other buckets untouched
    for _ in range(4):
        cal.observe_lookup(8, 8)
    assert cal.lookup(1) > 0.8 and cal.lookup(3) < cal.lookup(1)
    cal.observe_lookup(8, 0)  # rejected at depth 1: depth 2 was not judged
    assert cal.lookup_tries[:2] == [5, 4] and cal.lookup_hits[:2] == [4, 4]
    assert cal.lookup(2) / cal.lookup(1) > cal.lookup(1)  # past depth 1, runs go on
    cal.observe_lookup(3, 3)  # a short chain fully taken: depth 4 not judged
    assert len(cal.lookup_tries) == 8 and cal.lookup_tries[3] == 4


def test_lookup_depths_never_offered_are_judged_by_the_pooled_rate():
    cal = AcceptCalibration()
    for _ in range(40):
        cal.observe_lookup(3, 3)  # chains were cut at 3 and always taken
    assert cal.lookup_tries[3:] == []
    assert cal.lookup(4) / cal.lookup(3) > 0.9  # not a fixed 1/2 that would keep depth 4 pruned


def test_min_useful_prob_scales_with_the_marginal_verify_cost():
    flat, steep = VerifyCost({1: 10.0, 17: 10.0}), VerifyCost({1: 10.0, 17: 90.0})
    assert min_useful_prob(flat, 16, rate=0.05) == 0.0
    assert abs(min_useful_prob(steep, 16, rate=0.05) - 0.25) < 1e-9


def test_draft_gate_skips_the_head_when_it_loses_and_keeps_probing_both_sides():
    from adaptive_eagle.costmodel import DraftGate

    gate = DraftGate(probe_every=4, probe_winner_every=5)
    assert gate.allow(plain_estimate=0.03)  # nothing measured: draft
    gate.observe(True, tokens=1, ms=50.0)  # 0.02 tokens/ms < 0.03: drafting loses
    decisions = [gate.allow(0.03) for _ in range(8)]
    assert decisions == [False, False, False, True, False, False, False, True]  # a probe every 4th step
    for _ in range(10):
        gate.observe(True, tokens=4, ms=60.0)  # the text turned predictable: 0.067 tokens/ms
    decisions = [gate.allow(0.03) for _ in range(10)]
    assert decisions == [True, True, True, True, False] * 2  # winning: a step without the head every 5th
    for _ in range(10):
        gate.observe(False, tokens=4, ms=40.0)  # model-free drafts alone now do better: 0.1 tokens/ms
    assert not gate.allow(0.03)


def test_pinned_costs_are_checked_and_interpolated_like_measured_ones():
    import pytest

    from adaptive_eagle.costmodel import PinnedCosts

    pinned = PinnedCosts(verify_ms=[(1, 10), (17, 26.0)], overhead_ms=2)
    assert pinned.verify_ms == ((1, 10.0), (17, 26.0))
    assert pinned.verify_cost()(9) == 18.0 and pinned.verify_cost()(33) == 42.0
    assert PinnedCosts.flat(5.0).verify_cost()(64) == 5.0
    for bad, field in ((dict(verify_ms=()), "verify_ms"), (dict(verify_ms=((0, 1.0),)), "verify_ms"),
                       (dict(verify_ms=((1, float("nan")),)), "verify_ms"), (dict(verify_ms=((1, 1.0), (1, 2.0))),
                                                                            "verify_ms"),
                       (dict(verify_ms=((1, 1.0),), overhead_ms=-1.0), "overhead_ms")):
        with pytest.raises(ValueError, match=field):
            PinnedCosts(**bad)


def test_verify_cost_follows_the_context_length():
    """Attention reads every cached token per query row: the cost model grows with the context by a per-token
    slope measured at two contexts, and brings observations at any context back to its reference one."""
    c = VerifyCost({1: 10.0, 17: 30.0}, slope={1: 0.001, 17: 0.01}, ref=64)
    assert c(17) == 30.0 and c(17, 64) == 30.0  # no context given, or the reference one
    assert c(17, 2064) == pytest.approx(50.0) and c(1, 2064) == pytest.approx(12.0)
    assert c(9, 2064) == pytest.approx(20.0 + 0.0055 * 2000)  # both interpolated in q
    assert c.at(2064)(17) == c(17, 2064)
    c.observe(17, 60.0, 2064)  # 40 ms at the reference context
    assert c(17, 64) == pytest.approx(0.9 * 30.0 + 0.1 * 40.0)
    assert VerifyCost({1: 10.0})(1, 5000) == 10.0  # no slope measured: the context does not matter


def test_a_spike_never_makes_a_middle_size_dearer_than_a_larger_one():
    """A timing spike only adds time: a point (or a slope, multiplied by thousands of cached tokens) above a larger
    size's cost is capped by it, so the tree sizing does not avoid that size for good. Seen on the 2-core EPYC: 8
    rows charged 113.7 ms and 16 rows 56.9 at 2,994 cached tokens, and trees of 5-13 nodes were never chosen."""
    spiked = VerifyCost({1: 20.0, 8: 113.0, 17: 57.0})
    assert spiked(8) == 57.0 and spiked(17) == 57.0 and spiked(1) == 20.0
    assert spiked(4) == pytest.approx(20.0 + 3 / 7 * 37.0)  # interpolated under the cap, not towards the spike
    assert spiked(20) >= spiked(17)
    sloped = VerifyCost({1: 18.0, 8: 30.0, 17: 40.0}, slope={1: 0.003, 8: 0.03, 17: 0.006}, ref=64)
    at = sloped.at(3064)
    assert at(8) == pytest.approx(40.0 + 0.006 * 3000) == sloped(8, 3064)  # capped by 17 rows there
    assert at(8) < 30.0 + 0.03 * 3000 and at(1) == pytest.approx(18.0 + 0.003 * 3000)
    sizes = [at(q) for q in range(1, 30)]
    assert all(b >= a - 1e-9 for a, b in zip(sizes, sizes[1:]))  # never cheaper for more rows
    honest = VerifyCost({1: 10.0, 5: 30.0, 9: 50.0})  # already monotone: unchanged
    assert [honest(q) for q in (1, 3, 7, 13)] == [10.0, 20.0, 40.0, 70.0]


def test_the_plain_gate_decides_on_enough_steps_and_keeps_probing():
    from adaptive_eagle.costmodel import PlainGate

    g = PlainGate(min_steps=8, probe_every=4)
    plain = 1 / 20.0  # tokens per ms of a plain step
    for _ in range(7):  # speculative steps that lose (1 token in 30 ms)...
        assert g.allow(plain)
        g.observe(True, 1, 30.0)
    assert g.allow(plain)  # ...but 7 steps decide nothing
    g.observe(True, 1, 30.0)
    decisions = [g.allow(plain) for _ in range(8)]
    assert decisions == [False, False, False, True] * 2  # plain, probing every 4th step
    for _ in range(4):  # plain steps measured faster than estimated: the gate uses them
        g.observe(False, 1, 10.0)
    for _ in range(20):  # the text turns predictable: probes win and speculation resumes
        g.observe(True, 4, 30.0)
    assert g.allow(plain) and g.allow(plain)
