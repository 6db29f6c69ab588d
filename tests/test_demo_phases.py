"""A run through several drifts (`adaptive-eagle demo --scenario english,code,english,...`): a domain may come
back, the head kind is an option, and the per-phase figures (adaptive_eagle_cli/demo/phases.py) say what each
phase gained over the frozen head on the same requests, when a helping promotion came, and what a returning
domain forgot, with intervals. Synthetic requests whose accept lengths are set by hand."""

import pytest

from adaptive_eagle_cli.demo.config import DemoConfig, DemoConfigError, demo_stack_config, phase_plan
from adaptive_eagle_cli.demo.control import StepCounts
from adaptive_eagle_cli.demo.phases import phase_figures
from adaptive_eagle_cli.demo.report import markdown
from adaptive_eagle_cli.demo.traffic import Prompt, RequestResult


def test_a_domain_may_come_back_but_not_twice_in_a_row_and_the_head_kind_is_an_option(tmp_path):
    cfg = DemoConfig.make(scenario="english,code,math,tools,english,code")
    assert cfg.scenario == ("english", "code", "math", "tools", "english", "code")
    with pytest.raises(DemoConfigError, match="--scenario: code follows itself"):
        DemoConfig.make(scenario="english,code,code")
    with pytest.raises(DemoConfigError, match="--scenario"):
        DemoConfig.make(scenario=",".join(["english", "code"] * 7))  # 14 phases: at most 12
    with pytest.raises(DemoConfigError, match="--head"):
        DemoConfig.make(head="sparse")
    assert "moe_grow" not in demo_stack_config(cfg, str(tmp_path)).trainer.inner_fields()
    moe = demo_stack_config(DemoConfig.make(scenario="english,code", head="moe"), str(tmp_path)).trainer
    assert moe.inner_fields()["moe_grow"] and moe.inner_fields()["moe_grow_after_records"] == 50


def _requests(phase, domain, start, end, served, frozen, n=12, head="v1", tag=""):
    """n requests spread over [start, end) whose every step accepts `served` drafts as served and `frozen` as the
    frozen head replays it (5 steps each, the last one left out of accept length)."""
    out, counts = [], {}
    for k in range(n):
        rid = f"p{phase}{tag}-{k}"
        t = start + (end - start) * (k + 0.5) / n
        out.append(RequestResult(index=k, client=0, domain=domain, phase=phase, started_s=t, finished_s=t + 1,
                                 prompt=Prompt(({"role": "user", "content": "x"},), domain), ok=True, request_id=rid,
                                 text="t", completion_tokens=10, head_version=head, accept_length=1.0,
                                 verify_steps=5, tokens_per_s=20.0, arm="served", tpot_s=0.03))
        s, f = served(k) if callable(served) else served, frozen
        counts[rid] = StepCounts((s,) * 4 + (9,), (f,) * 4 + (0,))
    return out, counts


def test_each_phase_reports_its_gain_its_promotion_and_what_a_returning_domain_forgot():
    phases = phase_plan(("english", "code", "english"), 300.0, 1 / 3)  # 0-100, 100-200, 200-300
    results, counts = [], {}
    for rs, cs in [_requests(0, "english", 0, 100, 3, 2, n=18),  # english adapted: 4 vs 3 tokens a step
                   # code: the frozen head until a promotion at 150 s, then v2 better than frozen
                   _requests(1, "code", 100, 150, 1, 1, n=6),
                   _requests(1, "code", 150, 200, 2, 1, n=6, head="v2", tag="b"),
                   _requests(2, "english", 200, 300, 2, 2, n=18)]:  # back to english: the gain is gone
        results += rs
        counts.update(cs)
    figs = phase_figures(results, phases, counts, [(150.0, "v2"), (250.0, "v3")])
    assert [f["domain"] for f in figs] == ["english", "code", "english"]
    assert [(f["drifted"], f["returning"]) for f in figs] == [(False, False), (True, False), (True, True)]
    assert figs[0]["gain_pct"] == pytest.approx(100 * (4 / 3 - 1), abs=0.01)  # every request alike: a point interval
    assert figs[0]["gain_pct_interval"] == (pytest.approx(33.33, abs=0.01), pytest.approx(33.33, abs=0.01))
    assert figs[1]["time_to_promotion_s"] == 50.0 and figs[1]["promotions"] == 1
    # v3 was promoted in phase 2 but served none of its requests: a promotion, not one that helped the phase
    assert figs[2]["time_to_promotion_s"] is None and figs[2]["time_to_any_promotion_s"] == 50.0
    # english came back at 3 vs 3 tokens a step after leaving at 4 vs 3: all of the gain is lost
    assert figs[2]["forgetting_pct"] == pytest.approx(100 * (1 - 1 / (4 / 3)), abs=0.01)
    assert figs[0]["forgetting_pct"] is None and figs[1]["forgetting_pct"] is None
    text = markdown({**_summary(), "phase_figures": figs}, [], [], _info())
    assert "## Phases" in text and "| 2 | english | yes | 18 |" in text


def test_too_few_requests_give_no_figure_rather_than_a_noisy_one():
    phases = phase_plan(("english", "code"), 200.0, 0.5)
    rs, counts = _requests(0, "english", 0, 100, 3, 2, n=4)
    figs = phase_figures(rs, phases, counts, [])
    assert figs[0]["gain_pct"] is None and figs[0]["gain_pct_interval"] is None and figs[1]["requests"] == 0


def _summary():
    return {"replay_check": {}, "drift_domain": "code", "drift_window": "after adaptation",
            "drift_accept_length_adapted": None, "drift_accept_length_frozen": None, "drift_gain_pct": None,
            "requests": 0, "failed_requests": 0, "greedy_checks": {"checked": 0, "mismatches": 0},
            "candidates_considered": 0, "canaries": 0, "promotions": 0, "rollbacks": 0, "control": {
                "frozen_text_differs": 0}, "failures": []}


def _info():
    return {"when": "now", "duration_s": 1.0, "target": "t", "frozen_head": "v1", "scenario": ["english"],
            "clients": 1, "max_tokens": 8, "machine": "m", "config": {}}



def _gate(champion, candidate, needed=20, ids=None):
    """A canary_started event's offline evidence at the demo's settings, with the records it promoted on."""
    ids = ids or [f"g{i}" for i in range(len(champion))]
    return {"gate": "offline_sequential", "needed": needed, "max_samples": 2000, "level": 0.9, "quantile": 0.25,
            "statistic": "tail_mean", "paired_records": {"request_id": ids, "champion": list(champion),
                                                         "candidate": list(candidate)}}


def _promoted(seed, gain):
    """Paired records (champion, candidate) up to the look at which the demo's gate promotes a head `gain` x better
    on every record: evidence like a real promotion's, whose last record decided."""
    import numpy as np

    from bench.gate_sim import Setting, paired, promoted_at
    a, b = paired(np.random.default_rng(seed), 800, lambda g: gain * g)
    k = promoted_at(a, b, Setting("demo", 0.25, "tail_mean", 0.9, 20, mean_tolerance=0.5))[1]
    return a[:k], b[:k]


@pytest.fixture
def few_resamples(monkeypatch):
    from adaptive_eagle_cli.demo import phases
    monkeypatch.setattr(phases, "DECISION_RESAMPLES", 30)  # each resample re-runs the test on up to 3x the records


def test_the_time_to_promotion_has_an_interval_from_re_running_the_gate_on_its_own_records(few_resamples):
    import numpy as np

    from adaptive_eagle_cli.demo.phases import decision_time_interval
    from bench.gate_sim import paired
    rng = np.random.default_rng(3)
    a, b = _promoted(4, 1.5)
    n = len(a)
    finished = {f"g{i}": 10.0 + i for i in range(3 * n)}  # a record a second
    promoted = 10.0 + n - 1 + 30.0  # 30 s from its last record to the swap
    lo, hi = decision_time_interval(_gate(a, b), finished, promoted, rng)
    assert 10.0 + 19 + 30.0 <= lo < promoted < hi < 10.0 + 3 * n + 30.0, (lo, hi, promoted)  # never before `needed`
    same = paired(rng, n, lambda g: g)  # an equal head: the same evidence would rarely decide at all
    assert decision_time_interval(_gate(*same), finished, promoted, rng)[1] is None
    worse = paired(rng, n, lambda g: 0.8 * g)  # a worse head is rejected first: no promotion to time
    assert decision_time_interval(_gate(*worse), finished, promoted, rng) == (None, None)
    assert decision_time_interval(_gate(a, b), {}, promoted, rng) is None  # records of unknown requests
    gave_up = {k: v for k, v in finished.items() if k not in ("g5", "g6")}  # clients that gave up: no response
    assert decision_time_interval(_gate(a, b), gave_up, promoted, rng) is not None  # their times interpolated
    assert decision_time_interval({"gate": "offline"}, finished, promoted, rng) is None  # a gate without records


def test_evidence_that_drifted_keeps_its_own_time_to_promotion_inside_the_interval(few_resamples):
    """A drift inside the evidence: the candidate equals the champion on the first 250 records (the old domain) and
    is 1.6x better after (the new one), so the test passes only once enough new-domain records came. A resample
    that mixed all records would put the run's own decision below its interval (a 90% interval of about 390 to
    990 s here: the gain spread thin); kept local in arrival order, the decision lies inside it."""
    import numpy as np

    from adaptive_eagle_cli.demo.phases import decision_time_interval
    from bench.gate_sim import paired
    from policies.sequential import tail_evidence_path, tail_log_bar
    rng = np.random.default_rng(0)
    (a1, b1), (a2, b2) = paired(rng, 250, lambda g: g), paired(rng, 400, lambda g: 1.6 * g)
    a, b = np.r_[a1, a2], np.r_[b1, b2]
    k = int(np.flatnonzero(tail_evidence_path(a, b, 0.25, 0.1, "tail_mean") >= tail_log_bar(0.1))[0]) + 1
    finished = {f"g{i}": float(i) for i in range(k)}
    lo, hi = decision_time_interval(_gate(a[:k], b[:k]), finished, promoted_s=k - 1 + 30.0, rng=rng)
    assert 250 < k < 400 and lo <= k - 1 + 30.0 <= hi, (k, lo, hi)


def test_the_phase_figure_carries_the_interval_from_its_phases_start(few_resamples):
    a, b = _promoted(4, 1.5)
    phases = phase_plan(("english", "code", "english"), 3 * 2 * len(a), 1 / 3)  # a code phase of 2 s a record
    start, end = phases[1].start_s, phases[1].end_s
    results, counts = [], {}
    for rs, cs in [_requests(0, "english", 0, start, 2, 2, n=18),
                   _requests(1, "code", start, start + len(a), 1, 1, n=len(a)),  # the evidence: one record a second
                   _requests(1, "code", start + len(a) + 20, end, 2, 1, n=12, head="v2", tag="b"),
                   _requests(2, "english", end, phases[2].end_s, 2, 2, n=18)]:
        results += rs
        counts.update(cs)
    evidence = [r.request_id for r in results if r.phase == 1 and r.head_version == "v1"]
    promoted = start + len(a) + 15.0
    figs = phase_figures(results, phases, counts, [(promoted, "v2")], gates={"v2": _gate(a, b, ids=evidence)})
    lo, hi = figs[1]["time_to_promotion_s_interval"]
    assert figs[1]["time_to_promotion_s"] == round(promoted - start, 1) and 20 <= lo < promoted - start < hi, (lo, hi)
    assert figs[0]["time_to_promotion_s_interval"] is None  # no promotion in the phase
    assert phase_figures(results, phases, counts, [(promoted, "v2")])[1]["time_to_promotion_s_interval"] is None
    text = markdown({**_summary(), "phase_figures": figs}, [], [], _info())
    assert "to promotion s [90%]" in text and f"[{lo:.0f}, {hi:.0f}]" in text
