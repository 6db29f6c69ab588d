"""bench/continual.py's own arithmetic: the re-adaptation speed-up of a returning phase and the goals' verdicts
(True, False, or None where a phase it concerns has no figure). The runs themselves are demo runs."""

from bench.continual import goals, readapt


def _phase(domain, drifted, returning, gain=None, forget=None, to_promo=None, promotions=1):
    return {"domain": domain, "drifted": drifted, "returning": returning, "gain_pct": gain, "forgetting_pct": forget,
            "time_to_promotion_s": to_promo, "promotions": promotions}


def test_a_return_is_as_fast_as_its_promotion_against_the_domains_first_one():
    phases = readapt([_phase("english", False, False, 2.0, to_promo=300.0), _phase("code", True, False, 12.0, None, 200.0),
                      _phase("english", True, True, 11.0, 0.5, 100.0), _phase("code", True, True, 15.0, 3.0, None)])
    assert [p["readapt_speedup"] for p in phases] == [None, None, 3.0, None] and all(p["heldout"] for p in phases)
    assert goals(phases) == {"drifted_gain_at_least_10pct": True, "returning_forgets_at_most_1pct": False,
                             "returns_readapt_2x_faster": None}  # code's return had no promotion: cannot say


def test_a_drifted_phase_below_the_goal_fails_it_and_a_missing_figure_is_no_verdict():
    phases = readapt([_phase("english", False, False), _phase("code", True, False, 4.0)])
    assert goals(phases)["drifted_gain_at_least_10pct"] is False
    assert goals(readapt([_phase("english", False, False), _phase("code", True, False)]))[
        "drifted_gain_at_least_10pct"] is None
    assert goals([])["returning_forgets_at_most_1pct"] is None


def test_a_run_without_a_promotion_gains_nothing_and_cannot_be_said_to_remember():
    phases = readapt([_phase("english", False, False, 0.0, promotions=0), _phase("code", True, False, 0.0, promotions=0),
                      _phase("english", True, True, 0.0, 0.0, promotions=0)])
    g = goals(phases)
    assert g["drifted_gain_at_least_10pct"] is False and g["returning_forgets_at_most_1pct"] is None
    assert "no promotion" in g["why"]


def test_a_run_that_writes_no_summary_is_an_error_even_over_an_old_report(tmp_path, monkeypatch):
    import argparse
    import json

    from bench import continual

    out = tmp_path / "dense"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps({"phase_figures": [], "promotions": 3}))  # an earlier run's
    monkeypatch.setattr(continual.sys, "executable", "false")  # the demo process fails at once
    args = argparse.Namespace(scenario="english,code", minutes=1.0, seed=0, quick=True)
    got = continual.run_one("dense", args, out)
    assert got["exit_code"] != 0 and "no summary.json" in got["error"]
