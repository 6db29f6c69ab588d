"""policies.gates: table tests of the promotion gates, the cold-start gate and the rollback check, and a
property test: a candidate drawn from an equal or worse distribution is promoted no more often than the
configured false-promotion rate (1 - confidence level), while a clearly better one is promoted."""

from __future__ import annotations

from dataclasses import FrozenInstanceError

import numpy as np
import pytest

from adaptive_eagle.versions import PLAIN
from policies.gates import (
    CONTINUE, HOLD, PROMOTE, REJECT, ROLLBACK, Decision, canary_gate, cold_start_gate, compare, offline_gate,
    pair_by_request, rollback_check, tail_of,
)
from policies.samples import RequestSample
from tests.policies.helpers import accept_lengths, samples
from tests.policies.helpers import small_config as _small_config


def small_config(**kw):
    """This file tests the bootstrap gates, whose canary looks once (sequential=False); the anytime-valid
    canaries are tested in test_sequential.py."""
    return _small_config(**{"sequential": False, **kw})


CFG = small_config()


# ---- scenarios: (champion samples, candidate samples) ---------------------------------------------
def paired(shift: float, n: int = 600, seed: int = 0, noise: float = 0.1):
    rng = np.random.default_rng(seed)
    d = rng.normal(0.0, 0.5, n)
    return (samples(accept_lengths(rng, n, difficulty=d, noise=noise), "v1"),
            samples(accept_lengths(rng, n, difficulty=d, noise=noise, shift=shift), "v2"))


def unpaired(shift: float, n: int = 400, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (samples(accept_lengths(rng, n), "v1", ids="a"),
            samples(accept_lengths(rng, n, shift=shift), "v2", ids="b"))


def mean_win_tail_loss(seed: int = 0):
    """The candidate accepts more on most requests but collapses to 1.0 on 12% of them."""
    rng = np.random.default_rng(seed)
    n = 600
    champion = accept_lengths(rng, n, spread=0.3)
    candidate = np.where(rng.random(n) < 0.12, 1.0, accept_lengths(rng, n, spread=0.3, shift=0.25))
    return samples(champion, "v1", ids="a"), samples(candidate, "v2", ids="b")


def narrower_lower_mean(seed: int = 0):
    """Tail up, mean down: the candidate's latent is half as spread (p5 higher, long upper tail gone)."""
    rng = np.random.default_rng(seed)
    d = rng.normal(0.0, 0.5, 800)
    return samples(1 + np.exp(d), "v1"), samples(1 + np.exp(0.5 * d), "v2")


def one_domain_regresses(seed: int = 0):
    """English (most traffic) improves clearly; code (accepts more, so not the overall tail) drops ~8%."""
    rng = np.random.default_rng(seed)
    en, code = rng.normal(0.0, 0.4, 900), rng.normal(1.0, 0.3, 300)
    champion = samples(1 + np.exp(en), "v1", domain="english") + \
        samples(1 + np.exp(code), "v1", domain="code", ids="c")
    candidate = samples(1 + np.exp(en + 0.3), "v2", domain="english") + \
        samples(1 + np.exp(code - 0.12), "v2", domain="code", ids="c")
    return champion, candidate


def identical(seed: int = 0):
    champion, _ = paired(0.0, seed=seed)
    return champion, [RequestSample(s.accept_length, "v2", s.domain, s.request_id) for s in champion]


@pytest.mark.parametrize("name, gate, scenario, action, words", [
    ("clear win (paired replay)", offline_gate, lambda: paired(0.3), PROMOTE, "improves"),
    ("clear win (live canary)", canary_gate, lambda: unpaired(0.3), PROMOTE, "improves"),
    ("mean win but tail loss", offline_gate, mean_win_tail_loss, REJECT, "does not improve"),
    ("mean win but tail loss (canary)", canary_gate, mean_win_tail_loss, REJECT, "does not improve"),
    ("tail win but mean loss", offline_gate, narrower_lower_mean, REJECT, "mean"),
    ("too few replayed records", offline_gate, lambda: paired(0.3, n=CFG.min_samples - 1), CONTINUE, "need"),
    ("too few canary requests", canary_gate, lambda: unpaired(0.3, n=CFG.canary_min_requests - 1), CONTINUE,
     "need"),
    ("one domain regresses", offline_gate, one_domain_regresses, REJECT, "code"),
    ("identical heads", offline_gate, identical, REJECT, "does not improve"),
    ("same distribution, live", canary_gate, lambda: unpaired(0.0), REJECT, ""),
    ("worse candidate", offline_gate, lambda: paired(-0.2), REJECT, ""),
])
def test_promotion_gates(name, gate, scenario, action, words):
    champion, candidate = scenario()
    decision = gate(champion, candidate, CFG)
    assert decision.action == action, (name, decision.reason)
    assert words in decision.reason
    assert decision.reason.count(". ") == 0 and decision.reason.endswith("."), "one sentence"


def test_scenarios_are_what_they_claim():
    """The table's scenarios really have the property their name says (else the table proves nothing)."""
    cmp = compare(*mean_win_tail_loss(), CFG)
    assert cmp.mean_gain > 0 > cmp.tail_gain
    cmp = compare(*narrower_lower_mean(), CFG, paired=True)
    assert cmp.tail_gain > 0 > cmp.mean_gain and cmp.ci_low > 0
    cmp = compare(*one_domain_regresses(), CFG)
    assert cmp.ci_low > 0 and cmp.mean_gain > 0
    rows = {r.domain: r for r in cmp.domains}
    assert rows["code"].checked and rows["code"].regressed and not rows["english"].regressed
    assert rows["code"].tail_candidate < rows["code"].tail_champion


def test_tolerances_decide_the_borderline_cases():
    # the same data promote once the tolerance that rejected them is widened
    assert offline_gate(*one_domain_regresses(), small_config(domain_tolerance=0.5)).action == PROMOTE
    assert offline_gate(*narrower_lower_mean(), small_config(mean_tolerance=0.1)).action == PROMOTE
    # a domain with too little traffic is not checked
    champion, candidate = one_domain_regresses()
    cfg = small_config(min_domain_samples=301, min_samples=400)
    assert offline_gate(champion, candidate, cfg).action == PROMOTE
    assert not {r.domain: r for r in compare(champion, candidate, cfg).domains}["code"].checked


def test_evidence_holds_the_numbers():
    champion, candidate = paired(0.3)
    d = offline_gate(champion, candidate, CFG.model_copy(update={"tail_statistic": "quantile"}))
    ev = d.evidence
    assert ev["gate"] == "offline" and ev["paired"] and ev["metric"] == "accept_length"
    assert ev["n_champion"] == ev["n_candidate"] == len(champion)
    assert ev["tail_champion"] == pytest.approx(np.quantile([s.accept_length for s in champion], 0.05))
    assert ev["tail_gain"] == pytest.approx(ev["tail_candidate"] - ev["tail_champion"])
    assert ev["ci_low"] <= ev["tail_gain"] <= ev["ci_high"] and ev["level"] == CFG.confidence_level
    assert [r["domain"] for r in ev["domains"]] == ["-"] and ev["dropped_unpaired"] == 0


def test_pairing_by_request_id():
    champion, candidate = paired(0.3, n=300)
    a, b = pair_by_request(champion, list(reversed(candidate[50:])))
    assert [s.request_id for s in a] == [s.request_id for s in b] and len(a) == 250
    assert offline_gate(champion, candidate[50:], CFG).evidence["dropped_unpaired"] == 50
    dup = candidate[:-1] + [candidate[0]]
    assert pair_by_request(champion, dup) is None  # a repeated id: cannot pair
    assert pair_by_request(champion, [RequestSample(1.5)] * 3) is None  # no ids
    assert offline_gate(champion, dup, CFG).evidence["paired"] is False


def test_pairing_narrows_the_interval():
    champion, candidate = paired(0.05, n=600, noise=0.05)
    width = [(c.ci_high - c.ci_low) for c in (compare(champion, candidate, CFG, paired=True),
                                               compare(champion, candidate, CFG, paired=False))]
    assert width[0] < width[1]


def test_gates_are_deterministic():
    """The same evidence, the same decision (the bootstrap is seeded). How long a gate takes is not a test's
    verdict: a loaded machine would fail it."""
    champion, candidate = paired(0.02, n=3000)
    cfg = small_config(bootstrap_resamples=2000)
    decisions = [offline_gate(champion, candidate, cfg), canary_gate(champion, candidate, cfg)]
    assert decisions == [offline_gate(champion, candidate, cfg), canary_gate(champion, candidate, cfg)]


def test_decision_is_frozen_and_checks_its_action():
    with pytest.raises(ValueError, match="action"):
        Decision("maybe", "x")
    with pytest.raises(FrozenInstanceError):
        Decision(HOLD, "x").action = PROMOTE


# ---- cold start: champion "none" ---------------------------------------------------------------------
def timed(n: int, tpot_ms: float, accept: float, version: str, seed: int, spread: float = 0.15):
    rng = np.random.default_rng(seed)
    tpot = tpot_ms / 1000 * np.exp(rng.normal(0, spread, n))
    return samples(np.full(n, accept), version, tpot=tpot, ids=version)


@pytest.mark.parametrize("name, head_tpot_ms, head_accept, n, action, words", [
    ("faster at the tail", 30.0, 1.6, 300, PROMOTE, "P95 TPOT improves"),
    ("accepts tokens but is slower", 45.0, 1.3, 300, REJECT, "P95 TPOT does not improve"),
    ("as fast as plain", 40.0, 1.2, 300, REJECT, ""),
    ("too few timed requests", 30.0, 1.6, 100, CONTINUE, "timed requests"),
])
def test_cold_start_gate(name, head_tpot_ms, head_accept, n, action, words):
    plain = timed(n, 40.0, 1.0, PLAIN, seed=1)
    head = timed(n, head_tpot_ms, head_accept, "v1", seed=2)
    decision = cold_start_gate(plain, head, small_config(canary_min_requests=200))
    assert decision.action == action, decision.reason
    assert words in decision.reason
    if action != CONTINUE:
        ev = decision.evidence
        assert ev["metric"] == "tpot_s" and ev["quantile"] == 0.95 and not ev["higher_is_better"]
        assert ev["tail_champion"] == pytest.approx(np.quantile([s.tpot_s for s in plain], 0.95))
        assert (ev["tail_gain"] > 0) == (head_tpot_ms < 40.0)


def test_cold_start_ignores_untimed_samples():
    plain = timed(300, 40.0, 1.0, PLAIN, seed=1)
    head = timed(300, 30.0, 1.6, "v1", seed=2)
    untimed = [RequestSample(1.6, "v1", request_id=f"u{i}") for i in range(500)]
    assert cold_start_gate(plain, head[:150] + untimed, CFG).action == CONTINUE


# ---- rollback check -------------------------------------------------------------------------------
def live(values, version="v2", t0=100.0):
    return [RequestSample(float(v), version, request_id=f"l{i}", finished_at=t0 + i) for i, v in enumerate(values)]


RCFG = small_config(rollback_window=200, collapse_min_requests=20)


@pytest.mark.parametrize("name, n, live_shift, collapsed, action, words", [
    ("too early to judge", 10, 0.0, False, CONTINUE, "watching"),
    ("collapse is caught early", 25, 0.0, True, ROLLBACK, "collapse"),
    ("healthy, window not full", 100, 0.0, False, CONTINUE, "watching"),
    ("healthy at the window", 200, 0.0, False, HOLD, "watch passed"),
    ("slightly worse, within the margin", 200, -0.02, False, HOLD, "not wholly below the 5% margin"),
    ("far below the previous champion", 200, -0.5, False, ROLLBACK, "fell"),
])
def test_rollback_check(name, n, live_shift, collapsed, action, words):
    rng = np.random.default_rng(3)
    baseline = samples(accept_lengths(rng, 400, shift=0.3, spread=0.3), "v1")
    values = 1 + rng.uniform(0, 0.04, n) if collapsed else accept_lengths(rng, n, shift=0.3 + live_shift, spread=0.3)
    decision = rollback_check(baseline, live(values), RCFG)
    assert decision.action == action, decision.reason
    assert words in decision.reason


def test_rollback_check_uses_the_latest_window():
    rng = np.random.default_rng(4)
    baseline = samples(accept_lengths(rng, 400, shift=0.3, spread=0.3), "v1")
    good = accept_lengths(rng, 300, shift=0.3, spread=0.3)
    collapsed = 1 + rng.uniform(0, 0.04, RCFG.rollback_window)
    values = live(np.concatenate([good, collapsed]))
    assert rollback_check(baseline, values[::-1], RCFG).action == ROLLBACK  # ordered by finished_at, not input


def test_the_watch_line_says_the_time_per_token_effect_next_to_the_accept_length_one():
    rng = np.random.default_rng(7)
    base = [RequestSample(float(v), "v1", request_id=f"b{i}", tpot_s=0.030) for i, v in
            enumerate(accept_lengths(rng, 300, shift=0.3, spread=0.3))]
    after = [RequestSample(float(v), "v2", request_id=f"l{i}", tpot_s=0.025, finished_at=i) for i, v in
             enumerate(accept_lengths(rng, 200, shift=0.3, spread=0.3))]
    decision = rollback_check(base, after, RCFG)
    assert decision.action == HOLD
    assert "median TPOT 30.0 -> 25.0 ms (before vs after: not a test" in decision.reason
    assert decision.evidence["median_tpot_after"] == pytest.approx(0.025)
    untimed = [RequestSample(s.accept_length, "v2", request_id=s.request_id, finished_at=s.finished_at) for s in after]
    assert "TPOT" not in rollback_check(base, untimed, RCFG).reason  # nothing timed: nothing said


def test_rollback_against_plain_decoding_compares_wall_time():
    plain = timed(300, 40.0, 1.0, PLAIN, seed=5)
    slower = [RequestSample(1.4, "v1", request_id=s.request_id, tpot_s=s.tpot_s * 1.5, finished_at=i)
              for i, s in enumerate(timed(200, 40.0, 1.4, "v1", seed=6))]
    decision = rollback_check(plain, slower, RCFG)
    assert decision.action == ROLLBACK and decision.evidence["metric"] == "tpot_s"
    faster = [RequestSample(1.4, "v1", tpot_s=s.tpot_s * 0.8, finished_at=i)
              for i, s in enumerate(timed(200, 40.0, 1.4, "v1", seed=6))]
    assert rollback_check(plain, faster, RCFG).action == HOLD


# ---- property: false promotions ------------------------------------------------------------------
SEEDS = 250


def _promotion_rate(gate, draw, cfg, seeds=SEEDS) -> float:
    promoted = 0
    for seed in range(seeds):
        champion, candidate = draw(seed)
        promoted += gate(champion, candidate, cfg.model_copy(update={"seed": seed})).action == PROMOTE
    return promoted / seeds


@pytest.mark.parametrize("pairing", ["paired replay", "live canary"])
@pytest.mark.parametrize("shift", [0.0, -0.03])
@pytest.mark.parametrize("statistic", ["quantile", "tail_mean"])
def test_equal_or_worse_candidates_are_rarely_promoted(pairing, shift, statistic):
    """Tail test alone (tolerances wide open, level 0.9 so that false promotions are frequent enough to
    measure): the rate stays within the configured 1 - level plus sampling slack (2.5 binomial sds), for
    either tail statistic."""
    cfg = small_config(confidence_level=0.9, mean_tolerance=0.5, domain_tolerance=0.5, min_samples=200,
                       canary_min_requests=200, bootstrap_resamples=500, tail_statistic=statistic)
    gate = offline_gate if pairing == "paired replay" else canary_gate
    draw = (lambda s: paired(shift, n=250, seed=s, noise=0.3)) if gate is offline_gate else \
        (lambda s: unpaired(shift, n=250, seed=s))
    allowed = 1 - cfg.confidence_level
    rate = _promotion_rate(gate, draw, cfg)
    assert rate <= allowed + 2.5 * np.sqrt(allowed * (1 - allowed) / SEEDS), rate


def test_clearly_better_candidates_are_promoted():
    """The other side of the property: the same gate is not simply shy."""
    cfg = small_config(bootstrap_resamples=500)
    assert _promotion_rate(offline_gate, lambda s: paired(0.3, n=250, seed=s, noise=0.3), cfg, seeds=20) >= 0.9
    assert _promotion_rate(canary_gate, lambda s: unpaired(0.3, n=250, seed=s), cfg, seeds=20) >= 0.8


def test_a_non_inferiority_canary_passes_an_equal_head_and_stops_a_clearly_worse_one():
    """canary_margin > 0: the canary confirms live what the paired offline gate proved; an equal head passes
    (the strict canary rejects it), one worse beyond the margin does not, and the reason names the margin."""
    cfg = small_config(canary_margin=0.1, bootstrap_resamples=500)
    equal = canary_gate(*unpaired(0.0), cfg)
    assert canary_gate(*unpaired(0.0), CFG).action == REJECT
    assert equal.action == PROMOTE and "10% margin" in equal.reason
    assert equal.evidence["floor"] < 0 and equal.evidence["ci_low"] > equal.evidence["floor"]
    worse = canary_gate(*unpaired(-0.6), cfg)  # the tail ~14% lower
    assert worse.action == REJECT and "worse by more than the 10% margin" in worse.reason
    assert worse.reason.count(". ") == 0 and worse.reason.endswith(".")
    # the offline gate ignores the canary margin: a gain must still be shown on paired replay
    assert offline_gate(*identical(), cfg).action == REJECT
    # mean and domain checks still apply to a non-inferior canary
    assert canary_gate(*one_domain_regresses(), small_config(canary_margin=0.2, canary_min_requests=20)).action \
        == REJECT


def test_the_tail_mean_averages_the_lowest_share_and_resolves_a_gain_a_quartile_cannot_at_small_n():
    x = np.array([5.0, 1.0, 3.0, 2.0, 8.0, 4.0, 7.0, 6.0])
    assert tail_of(x, 0.25, "tail_mean") == 1.5 and tail_of(x, 0.3, "tail_mean") == 2.0  # ceil(q·n) lowest
    assert tail_of(x, 0.25) == np.quantile(x, 0.25)
    grid = np.stack([x, x + 1.0, x[::-1]])
    assert np.allclose(tail_of(grid, 0.25, "tail_mean", axis=-1), [1.5, 2.5, 1.5])  # vectorised, any order
    assert np.allclose(tail_of(grid.T, 0.25, "tail_mean", axis=0), [1.5, 2.5, 1.5])
    with pytest.raises(ValueError, match="tail_mean"):
        tail_of(x, 0.25, "median")
    # 32 paired records, a candidate better by a few percent everywhere with per-record noise: the quartile
    # difference interpolates one or two records, the tail mean averages eight of them
    cfg = small_config(min_samples=20, min_domain_samples=10, tail_quantile=0.25, confidence_level=0.9,
                       bootstrap_resamples=500)
    rates = {stat: _promotion_rate(offline_gate, lambda s: paired(0.06, n=32, seed=s, noise=0.08),
                                   cfg.model_copy(update={"tail_statistic": stat}), seeds=40)
             for stat in ("quantile", "tail_mean")}
    assert rates["tail_mean"] > rates["quantile"], rates
    d = offline_gate(*paired(0.3), small_config(tail_statistic="tail_mean"))
    assert d.action == PROMOTE and "lowest 5%" in d.reason and d.evidence["statistic"] == "tail_mean"
