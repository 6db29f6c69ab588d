"""The holdback arm's record and window: a stable share of requests, drawn independently of the canary's, and
per domain the frozen arm's median time per output token over the served arm's, with a bootstrap interval, shown
only once both arms have enough requests."""

import pytest

from policies.canary import Canary
from policies.holdback import BLOCK, MIN_PER_ARM, Holdback, HoldbackWindow


def test_the_arm_takes_a_stable_share_independent_of_the_canary():
    held, canary = Holdback("v1", 0.1), Canary("v2", 0.5)
    ids = [f"req-{i}" for i in range(20_000)]
    takes = [held.takes(r) for r in ids]
    assert takes == [held.takes(r) for r in ids]  # stable per id
    assert 0.09 < sum(takes) / len(ids) < 0.11
    both = sum(t and canary.takes(r) for t, r in zip(takes, ids))
    assert 0.45 < both / sum(takes) < 0.55  # the canary's share of held-back requests is its share of all
    assert not any(Holdback("v1", 0.0).takes(r) for r in ids[:1000])
    with pytest.raises(ValueError, match=r"\[0, 0.5\]"):
        Holdback("v1", 0.6)


def test_the_gain_is_shown_once_both_arms_have_enough_requests_and_says_which_way():
    w = HoldbackWindow(max_per_arm=100)
    for i in range(MIN_PER_ARM - 1):
        w.add("code", "served", 0.020 + 0.0001 * i, 2.5)
        w.add("code", "holdback", 0.030 + 0.0001 * i, 1.8)
    assert w.gain("code") is None
    w.add("code", "served", 0.021, 2.5)
    w.add("code", "holdback", 0.031, 1.8)
    g = w.gain("code")
    assert g is not None and g.served == g.holdback == MIN_PER_ARM
    assert g.tpot_gain == pytest.approx(0.031 / 0.021, rel=0.05)
    assert g.tpot_gain_90[0] <= g.tpot_gain <= g.tpot_gain_90[1]
    assert g.tpot_gain_90[0] > 1.0  # adapted clearly faster
    assert g.accept_gain == pytest.approx(2.5 / 1.8)
    assert w.gain("english") is None and w.domains() == ["code"]
    with pytest.raises(ValueError, match="arm"):
        w.add("code", "canary", 0.02, 2.0)


def test_the_window_keeps_the_newest_requests():
    w = HoldbackWindow(max_per_arm=MIN_PER_ARM)
    for _ in range(MIN_PER_ARM):
        w.add(None, "served", 0.05, 1.0)
        w.add(None, "holdback", 0.05, 1.0)
    for _ in range(MIN_PER_ARM):  # the served arm got twice as fast: the old requests fall out
        w.add(None, "served", 0.025, 2.0)
    assert w.gain("none").tpot_gain == pytest.approx(2.0) and w.counts()[("none", "served")] == MIN_PER_ARM


def test_forgetting_compares_the_newest_block_with_the_best_each_relative_to_the_frozen_arm():
    import random

    rng = random.Random(0)
    w = HoldbackWindow(max_per_arm=200, block=BLOCK)
    for _ in range(BLOCK):  # a block closing before the frozen arm has MIN_PER_ARM requests is dropped
        w.add("code", "served", 0.02, 2.0)
    for _ in range(MIN_PER_ARM):
        w.add("code", "holdback", 0.03, 1.6 + rng.uniform(-0.1, 0.1))

    def block(level):
        for _ in range(BLOCK):
            w.add("code", "served", 0.02, level + rng.uniform(-0.2, 0.2))

    block(2.4)
    assert w.forgetting("code") is None  # one block: nothing to compare with
    block(2.4)
    same = w.forgetting("code")
    assert same.blocks == 2 and same.pct_90[0] <= same.pct <= same.pct_90[1] and same.pct_90[0] < 0.5
    block(2.0)  # the head lost 1/6 of its accept length on code: (2.4 - 2.0) / 2.4
    f = w.forgetting("code")
    assert f.blocks == 3 and f.pct == pytest.approx(100 / 6, abs=5) and f.pct_90[0] > 10
    assert f.best_gain > f.newest_gain and w.forgetting("english") is None
    block(2.4)  # relearned
    assert abs(w.forgetting("code").pct) < 5
    assert set(w.medians("code")) == {"served", "holdback"} and w.medians("english") == {}
    with pytest.raises(ValueError, match="block"):
        HoldbackWindow(block=MIN_PER_ARM - 1)
