"""The anytime-valid canaries (policies/sequential.py, the sequential and health canary gates) by simulation,
checked after every sample as a policy that ticks would:

- the bounds cover their quantile at every sample size at once, at or above their level;
- an evidence canary between two equal heads, looked at after every live request, promotes no more often than
  the configured rate (the one-look bootstrap canary looked at as often promotes far more: why the sequential
  one exists), and a head 5% better is promoted within 4,000 live requests a head;
- a health canary rejects an equal head no more often than the configured rate however often it looks, and
  rejects a collapsed, a less accepting or a slower head early.

The sequential offline gate (paired test-then-train evidence) has its own file, test_offline_gate.py.

Every bound is running (a decision it allowed once stays allowed), so the gate's rule checked after each sample
is the rule applied to the bounds' paths; `test_the_gates_agree_with_the_paths` ties the two together."""

from __future__ import annotations

import numpy as np
import pytest

from policies.gates import CONTINUE, PROMOTE, REJECT, canary_gate, health_canary_gate, sequential_canary_gate
from policies.samples import RequestSample
from policies.sequential import quantile_bound, quantile_bound_path, rejecting_count
from tests.policies.helpers import samples, small_config


def accept_lengths(rng, n: int, scale: float = 1.0) -> np.ndarray:
    """Per-request accept length: 1 + Gamma(4, 0.18) (mean 1.72, p5 1.25), times `scale` ("5% better": 1.05),
    never under 1 (plain decoding's)."""
    return np.maximum(1.0, (1.0 + rng.gamma(4.0, 0.18, n)) * scale)


def live(values, version: str, tpot=None) -> list[RequestSample]:
    tpot = np.full(len(values), 0.05) if tpot is None else tpot
    return [RequestSample(float(a), version, None, f"{version}-{i}", tpot_s=float(t), finished_at=float(i))
            for i, (a, t) in enumerate(zip(values, tpot))]


# ---- the bounds -----------------------------------------------------------------------------------
def test_the_bounds_hold_at_every_sample_size_at_once():
    """Over 300 runs of 300 samples, the share of runs whose lower bound ever rose above the truth (checked
    after every sample, via the running path) is at most alpha (0.1, plus sampling slack), for two quantiles of a
    discrete distribution (ties); the upper bound likewise. (On 1,000 runs: 0.04-0.08.)"""
    rng = np.random.default_rng(0)
    population = np.round(1 + rng.gamma(4, 0.18, 2_000_000), 2)
    truth = {q: np.quantile(population, q) for q in (0.05, 0.5)}
    ever = {(q, side): 0 for q in truth for side in ("lower", "upper")}
    runs = 300
    for _ in range(runs):
        x = np.round(1 + rng.gamma(4, 0.18, 300), 2)
        for q, value in truth.items():
            ever[q, "lower"] += bool((quantile_bound_path(x, q, 0.1) > value).any())
            ever[q, "upper"] += bool((quantile_bound_path(x, q, 0.1, "upper") < value).any())
    slack = 2.5 * np.sqrt(0.1 * 0.9 / runs)  # sampling slack of the estimated rate (2.5 binomial sds)
    assert all(n / runs <= 0.1 + slack for n in ever.values()), ever


def test_the_bounds_tighten_with_samples_and_mirror_for_the_upper_side():
    rng = np.random.default_rng(1)
    x = accept_lengths(rng, 2000)
    lo, hi = quantile_bound_path(x, 0.5, 0.05), quantile_bound_path(x, 0.5, 0.05, "upper")
    assert (np.diff(lo[np.isfinite(lo)]) >= 0).all() and (np.diff(hi[np.isfinite(hi)]) <= 0).all()  # never loosen
    assert np.isfinite(lo[-1]) and np.isfinite(hi[-1])
    assert lo[-1] < np.median(x) < hi[-1] and hi[-1] - lo[-1] < 0.08
    q_lo, q_hi = quantile_bound(x, 0.05, 0.05), quantile_bound(x, 0.05, 0.05, "upper")
    assert q_lo < np.quantile(x, 0.05) < q_hi and q_hi - q_lo < 0.1
    assert quantile_bound(x[:10], 0.05, 0.05) == -np.inf  # ten samples cannot bound a 5th percentile from below
    assert quantile_bound(x[:10], 0.05, 0.05, "upper") < np.inf  # ... from above they can
    assert quantile_bound([], 0.5, 0.05) == -np.inf and quantile_bound([], 0.5, 0.05, "upper") == np.inf
    assert rejecting_count(10, 0.05, 0.05) == -1 and rejecting_count(2000, 0.05, 0.05) > 0
    with pytest.raises(ValueError, match="alpha"):
        quantile_bound(x, 0.5, 1.5)
    with pytest.raises(ValueError, match="q must"):
        quantile_bound(x, 1.0, 0.05)


# ---- the evidence canary --------------------------------------------------------------------------
def promoted_at(a: np.ndarray, b: np.ndarray, q: float, level: float, margin: float = 0.0, first: int = 20):
    """The first sample count (per head, heads served alternately) at which the sequential evidence canary's
    promote rule holds, looking after every request from `first` on; None if never."""
    alpha = (1 - level) / 2
    ok = quantile_bound_path(b, q, alpha) > (1 - margin) * quantile_bound_path(a, q, alpha, "upper")
    ok[:first - 1] = False
    return int(np.argmax(ok)) + 1 if ok.any() else None


def test_an_equal_head_is_rarely_promoted_by_the_sequential_canary_however_often_it_looks():
    """Equal heads, 300 live requests each, the rule checked after every request: promotions at most
    1 - level (0.2 here, so that errors are frequent enough to count). The one-look bootstrap canary looked at
    after every 10 requests instead promotes an equal head in far more runs."""
    level, runs, n = 0.8, 200, 300
    rng = np.random.default_rng(2)
    seq = sum(promoted_at(accept_lengths(rng, n), accept_lengths(rng, n), 0.05, level) is not None
              for _ in range(runs))
    assert seq / runs <= 1 - level, seq
    cfg = small_config(confidence_level=level, sequential=False, canary_min_requests=20, bootstrap_resamples=200,
                       mean_tolerance=0.5, domain_tolerance=0.5)
    peeking = 0
    for run in range(40):
        a, b = live(accept_lengths(rng, n), "v1"), live(accept_lengths(rng, n), "v2")
        peeking += any(canary_gate(a[:k], b[:k], cfg.model_copy(update={"seed": run})).action == PROMOTE
                       for k in range(20, n + 1, 10))
    assert peeking / 40 > 1.5 * (1 - level), peeking  # repeated looks at a fixed-sample interval inflate errors


def test_a_head_five_percent_better_is_promoted_within_4000_live_requests():
    """Every request's accept length 5% higher (the p5 tail 1.25 -> 1.31): the default level (95%) promotes it
    within 4,000 live requests a head (canary_max_requests' default) in at least 18 of 20 runs."""
    rng = np.random.default_rng(3)
    level = small_config().confidence_level
    times = [promoted_at(accept_lengths(rng, 4000), accept_lengths(rng, 4000, 1.05), 0.05, level) for _ in range(20)]
    assert sum(t is not None for t in times) >= 18, times
    assert small_config().canary_max_requests == 4000


def test_the_gates_agree_with_the_paths():
    """The gate functions decide what the path rule says, and the reasons name the bounds."""
    rng = np.random.default_rng(4)
    cfg = small_config(canary_min_requests=20)
    a, b = accept_lengths(rng, 4000), accept_lengths(rng, 4000, 1.05)
    k = promoted_at(a, b, cfg.tail_quantile, cfg.confidence_level)
    assert k is not None
    before = sequential_canary_gate(live(a[:k - 1], "v1"), live(b[:k - 1], "v2"), cfg)
    at = sequential_canary_gate(live(a[:k], "v1"), live(b[:k], "v2"), cfg)
    assert before.action == CONTINUE and at.action == PROMOTE and "at least" in at.reason
    assert at.evidence["sequential"] and at.evidence["tail_lower_candidate"] > at.evidence["tail_upper_champion"]
    assert canary_gate(live(a[:k], "v1"), live(b[:k], "v2"), cfg).action == PROMOTE  # sequential is the default
    worse = sequential_canary_gate(live(a, "v1"), live(accept_lengths(rng, 4000, 0.85), "v2"), cfg)
    assert worse.action == REJECT and "cannot clear" in worse.reason
    capped = small_config(canary_min_requests=20, canary_max_requests=100)
    equal = sequential_canary_gate(live(a[:100], "v1"), live(accept_lengths(rng, 100), "v2"), capped)
    assert equal.action == REJECT and "inconclusive after 100" in equal.reason
    assert sequential_canary_gate(live(a[:19], "v1"), live(b[:19], "v2"), cfg).action == CONTINUE


# ---- the health canary ----------------------------------------------------------------------------
def health_rejected_at(a, b, ta, tb, cfg):
    """The first request count (per head) at which the health canary's harm rules hold, checked after every
    request; None if never."""
    alpha, m = (1 - cfg.confidence_level) / 4, cfg.canary_health_margin
    acc = quantile_bound_path(b, 0.5, alpha, "upper") < (1 - m) * quantile_bound_path(a, 0.5, alpha)
    slow = quantile_bound_path(tb, 0.5, alpha) > (1 + m) * quantile_bound_path(ta, 0.5, alpha, "upper")
    harm = acc | slow
    return int(np.argmax(harm)) + 1 if harm.any() else None


def tpots(rng, n, scale=1.0):
    return 0.05 * scale * rng.lognormal(0.0, 0.3, n)


def test_a_healthy_head_is_rarely_rejected_by_the_health_canary_however_often_it_looks():
    """Equal heads, 500 live requests each, harm checked after every request: rejections at most 1 - level
    (0.2 here)."""
    cfg = small_config(confidence_level=0.8)
    rng = np.random.default_rng(5)
    runs = 150
    rejected = sum(health_rejected_at(accept_lengths(rng, 500), accept_lengths(rng, 500), tpots(rng, 500),
                                      tpots(rng, 500), cfg) is not None for _ in range(runs))
    assert rejected / runs <= 1 - cfg.confidence_level, rejected


def test_the_health_canary_stops_a_collapsed_a_less_accepting_or_a_slower_head_early_and_passes_a_healthy_one():
    cfg = small_config(canary_health_requests=50)
    rng = np.random.default_rng(6)
    a, ta = accept_lengths(rng, 400), tpots(rng, 400)
    # a collapse: at collapse_min_requests
    collapsed = health_canary_gate(live(a[:20], "v1"), live(np.ones(20), "v2"), cfg)
    assert collapsed.action == REJECT and collapsed.reason.startswith("collapse")
    # accepting 25% less, or 40% slower: found within 150 requests
    k = health_rejected_at(a, accept_lengths(rng, 400, 0.75), ta, tpots(rng, 400), cfg)
    assert k is not None and k <= 150, k
    k = health_rejected_at(a, accept_lengths(rng, 400), ta, tpots(rng, 400, 1.4), cfg)
    assert k is not None and k <= 150, k
    less = health_canary_gate(live(a, "v1", ta), live(accept_lengths(rng, 400, 0.75), "v2", tpots(rng, 400)), cfg)
    assert less.action == REJECT and "median accept length is lower" in less.reason
    slower = health_canary_gate(live(a, "v1", ta), live(accept_lengths(rng, 400), "v2", tpots(rng, 400, 1.6)), cfg)
    assert slower.action == REJECT and "time per output token is higher" in slower.reason
    # healthy: continue until canary_health_requests, then promote
    b, tb = accept_lengths(rng, 50, 1.05), tpots(rng, 50)
    assert health_canary_gate(live(a[:49], "v1", ta[:49]), live(b[:49], "v2", tb[:49]), cfg).action == CONTINUE
    ok = health_canary_gate(live(a[:50], "v1", ta[:50]), live(b, "v2", tb), cfg)
    assert ok.action == PROMOTE and "healthy live over 50 requests" in ok.reason and ok.evidence["gate"] == \
        "canary_health"
