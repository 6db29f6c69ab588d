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
