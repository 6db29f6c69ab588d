"""`adaptive-eagle demo`: its options and report pieces (fast), and ONE short end-to-end run on the real
SmolLM2-135M target (slow): the stack serves drifting ShareGPT traffic through the openai client, a
candidate reaches the gates, and the report holds the log, the plot, the table and greedy-equal samples."""

import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
from typer.testing import CliRunner

from adaptive_eagle_cli.demo.config import DemoConfig, DemoConfigError, demo_stack_config, phase_plan
from adaptive_eagle_cli.demo.control import ControlSample, StepCounts
from adaptive_eagle_cli.demo.report import (adapt_line, helped_drifted_domain, latency_line, summary, table,
                                          time_to_adapt)
from adaptive_eagle_cli.demo.run import failed_checks, pool_size
from adaptive_eagle_cli.demo.traffic import (SESSIONS, Prompt, PromptCycle, RequestResult, SessionTurns, jsonl_pools,
                                            session_pool)
from policies.log import PromotionEvent

REPO = Path(__file__).resolve().parents[1]
SUMMARY_KEYS = {"drift_accept_length_adapted", "drift_accept_length_frozen", "failed_requests", "promotions",
                "time_to_first_candidate_s", "time_to_promotion_s", "recovered_fraction"}


def test_options_are_range_checked_and_errors_name_the_option(tmp_path):
    cfg = DemoConfig.make(scenario="english, code,math", minutes=2)
    assert cfg.scenario == ("english", "code", "math") and cfg.budget_s == 120
    for fields, named in [({"scenario": "english,klingon"}, "--scenario"), ({"clients": 0}, "--clients"),
                          ({"minutes": 0.1}, "--minutes"), ({"scenario": "code,code"}, "--scenario"),
                          ({"prompts": str(tmp_path / "missing.jsonl")}, "no such file")]:
        with pytest.raises(DemoConfigError, match=named):
            DemoConfig.make(**fields)
    from adaptive_eagle_cli import app

    res = CliRunner().invoke(app, ["demo", "--clients", "99"])
    assert res.exit_code == 2 and "--clients" in res.output and "[1, 16]" in res.output


def test_the_phase_plan_gives_the_baseline_its_share_and_splits_the_rest():
    phases = phase_plan(("english", "code", "math"), 100.0, 0.2)
    assert [(p.domain, p.start_s, p.end_s) for p in phases] == [("english", 0, 20), ("code", 20, 60), ("math", 60, 100)]
    assert phase_plan(("code",), 50.0, 0.3)[0].end_s == 50.0


def test_the_stack_config_turns_the_loop_within_minutes(tmp_path):
    cfg = demo_stack_config(DemoConfig.make(quick=True), str(tmp_path))
    engine = cfg.serving.engine
    assert not (engine.cost_aware or engine.prompt_lookup or engine.suffix_drafting)  # replay is exact
    assert cfg.serving.capture.fraction == 1.0 and cfg.trainer.yield_queue_depth in (0, 1)
    assert cfg.nearline_config().positions == "generated" and cfg.registry.seed_head.endswith("english-v2")
    assert cfg.policy.gates().min_samples == 20 and cfg.policy.gates().canary_margin > 0
    full = demo_stack_config(DemoConfig.make(), str(tmp_path))
    assert full.nearline_config().evidence == "prequential"  # test-then-train by default
    assert full.nearline_config().candidate_evidence_records >= full.policy.gates().min_samples
    # a snapshot every sixth of the run: a longer demo gives each snapshot a longer window of evidence
    hour = demo_stack_config(DemoConfig.make(minutes=60), str(tmp_path)).nearline_config()
    assert full.nearline_config().candidate_every_minutes == 2.5 and hour.candidate_every_minutes == 10.0
    assert hour.candidate_every_tokens == 4 * full.nearline_config().candidate_every_tokens
    held = demo_stack_config(DemoConfig.make(evidence="heldout"), str(tmp_path))
    assert held.nearline_config().min_candidate_heldout == held.policy.gates().min_samples  # no wasted candidates
    assert cfg.nearline_config().min_candidate_heldout == 1  # --quick: a candidate reaches the gates regardless


def test_the_long_scenario_drifts_from_english_chat_to_long_sessions(tmp_path):
    assert DemoConfig.make(scenario="long").scenario == ("english", SESSIONS)
    with pytest.raises(DemoConfigError, match="named scenario: long"):
        DemoConfig.make(scenario="long,code")  # `long` names a whole scenario, not a domain
    stack = demo_stack_config(DemoConfig.make(scenario="long"), str(tmp_path))
    # the served contexts fit, and the trainer trains them at full length (a capped trainer loses on long ones)
    assert 7000 <= stack.serving.max_prompt_tokens < 8192 - 256
    assert stack.nearline_config().max_len >= stack.serving.max_prompt_tokens + stack.serving.max_tokens_limit


@pytest.mark.slow  # reads the real ShareGPT file
def test_a_session_is_sent_turn_by_turn_with_the_models_own_answers():
    pool = session_pool(2, seed=0)
    assert 1 <= len(pool) <= 2 and all(p.domain == SESSIONS and p.session.turns for p in pool)
    place = SessionTurns.start(pool[0])
    sent = []
    while not place.done():
        prompt = place.prompt()
        sent.append(prompt)
        answer = RequestResult(index=len(sent), client=0, domain=SESSIONS, phase=0, started_s=0.0, finished_s=1.0,
                               prompt=prompt, ok=True, text=f"answer {len(sent)}", completion_tokens=3)
        place = place.after(prompt, answer)
    session = pool[0].session
    assert len(sent) == len(session.turns) and sent[0].messages[0] == {"role": "system", "content": session.system}
    for k, prompt in enumerate(sent[1:], start=1):  # each request: the previous one, its answer, the new turn
        assert prompt.messages[:len(sent[k - 1].messages)] == sent[k - 1].messages
        assert prompt.messages[len(sent[k - 1].messages)] == {"role": "assistant", "content": f"answer {k}"}
        assert prompt.messages[len(sent[k - 1].messages) + 1:] == tuple(session.turns[k])
    assert sum(len(m["content"]) for m in sent[-1].messages) > 8000  # a long context
    failed = RequestResult(index=0, client=0, domain=SESSIONS, phase=0, started_s=0.0, finished_s=1.0,
                           prompt=sent[0], ok=False, error="boom")
    assert SessionTurns.start(pool[0]).after(sent[0], failed) is None  # the session ends; the client starts anew


def test_prompts_are_not_reused_within_a_run_and_a_reuse_is_counted():
    """A prompt sent twice could be scored by test-then-train evidence after the trainer learnt its answer: the
    pools hold more than a run can send (every client one request a second), and any reuse is counted."""
    for minutes, clients, quick in ((15, 2, False), (60, 2, False), (60, 8, False), (12, 2, True)):
        cfg = DemoConfig.make(minutes=minutes, clients=clients, quick=quick, think_s=0.5 if quick else None)
        assert pool_size(cfg) >= minutes * 60 * clients / (1 + cfg.think_s)
    cycle = PromptCycle({"code": [Prompt((), "code"), Prompt((), "code")]})
    [cycle.take("code") for _ in range(2)]
    assert cycle.reused == 0
    cycle.take("code")
    assert cycle.reused == 1


def test_user_prompts_keep_their_domains_and_bad_lines_are_named(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hello there", "domain": "chat"}\n\n'
                    '{"messages": [{"role": "user", "content": "def f(): pass"}], "domain": "code"}\n'
                    '{"prompt": "no domain"}\n')
    pools = jsonl_pools(str(path), 0)
    assert {d: len(p) for d, p in pools.items()} == {"chat": 1, "code": 1, "custom": 1}
    path.write_text('{"prompt": "ok"}\n{"text": "wrong key"}\n')
    with pytest.raises(ValueError, match="p.jsonl:2"):
        jsonl_pools(str(path), 0)


def result(i, phase, domain, started, tokens=10, steps=5, head="v1", by_context=()):
    return RequestResult(index=i, client=0, domain=domain, phase=phase, started_s=started, finished_s=started + 1,
                         prompt=Prompt(({"role": "user", "content": "x"},), domain), ok=True, request_id=f"r{i}",
                         text="t", completion_tokens=tokens, head_version=head, accept_length=tokens / steps,
                         verify_steps=steps, tokens_per_s=20.0, by_context=by_context)


def test_the_table_sets_the_stack_next_to_the_frozen_head_on_the_same_requests():
    phases = phase_plan(("english", "code"), 90.0, 1 / 3)  # english 0-30, code 30-90 (thirds: 30-50, 70-90)
    results = [result(0, 0, "english", 5), result(1, 1, "code", 35, 8, 8), result(2, 1, "code", 75, 12, 6, "nl-1"),
               RequestResult(index=3, client=1, domain="code", phase=1, started_s=80, finished_s=81,
                             prompt=Prompt((), "code"), ok=False, error="APIConnectionError: boom")]
    counts = {"r0": StepCounts((1, 1, 0, 0, 9), (1, 1, 0, 0, 0)),  # the last step is left out: 6 / 4 both
              "r1": StepCounts((0,) * 8, (0,) * 8), "r2": StepCounts((2, 1, 1, 0, 1, 0), (0, 1, 0, 1, 0, 0))}
    control = [ControlSample("r2", "code", 1, 76, 15.0, 1.3, True)]
    rows = table(results, phases, counts, control)
    assert [(r.window, r.domain, r.requests) for r in rows] == [
        ("before drift", "english", 1), ("right after drift", "code", 1), ("after adaptation", "code", 1)]
    assert rows[0].accept_length_adapted == rows[0].accept_length_frozen == 1.5 and rows[0].gain_pct == 0.0
    after = rows[2]
    assert after.accept_length_adapted == 2.0 and after.accept_length_frozen == 1.4 and after.gain_pct == 42.86
    assert after.tokens_per_s_frozen == 15.0 and after.frozen_decoded == 1 and after.heads == "nl-1"
    assert StepCounts.accept_length((3,)) is None
    t0 = 1_800_000_000.0
    at = lambda s: PromotionEvent(time=datetime.fromtimestamp(t0 + s, timezone.utc).isoformat(), event="promoted",
                                  candidate="nl-1")  # noqa: E731
    adapt = time_to_adapt(phases, t0, [t0 + 10, t0 + 42, t0 + 60], [at(20), at(66.5)], rows)
    # from the drift (30 s): the candidate of 10 s is before it; the promotion of 20 s too
    assert adapt == {"drift_onset_s": 30.0, "time_to_first_candidate_s": 12.0, "time_to_promotion_s": 36.5,
                     "time_to_any_promotion_s": 36.5,
                     "recovered_fraction": 6.0,  # (2.0 - 1.4) / (1.5 - 1.4): more than the drop was won back
                     "accept_length_drop": 0.1}
    # a promotion counts for the drift only if the promoted head then served the drifted domain better than the
    # frozen head on the same requests: nl-1 did (r2: 2.0 vs 1.4); a head that served none of it does not count
    assert helped_drifted_domain(results, counts, phases, "nl-1") is True
    assert helped_drifted_domain(results, counts, phases, "nl-9") is None
    worse = {**counts, "r2": StepCounts((0, 0, 0, 0, 0, 0), (0, 1, 0, 1, 0, 0))}
    assert helped_drifted_domain(results, worse, phases, "nl-1") is False
    late = time_to_adapt(phases, t0, [t0 + 42], [at(40), at(66.5)], rows,
                         lambda v: helped_drifted_domain(results, worse, phases, v))
    assert late["time_to_promotion_s"] is None and late["time_to_any_promotion_s"] == 10.0
    assert "promotion 0.6 min" in adapt_line(adapt)
    assert "won back all of the accept-length drop (0.100) and more: the gain is 6.0x the drop" in adapt_line(adapt)
    assert "recovered 50% of the accept-length drop (0.100)" in adapt_line({**adapt, "recovered_fraction": 0.5})
    assert time_to_adapt(phases[:1], t0, [], [], rows)["time_to_promotion_s"] is None  # no drift, no figure
    assert latency_line(None).startswith("no candidate")
    s = summary(rows, results, [], [], control, adapt)
    assert SUMMARY_KEYS <= set(s) and s["failed_requests"] == 1 and s["drift_accept_length_adapted"] == 2.0


@pytest.mark.slow
@pytest.mark.timeout(960)
def test_a_quick_demo_runs_the_loop_end_to_end(tmp_path):
    """The real target, --quick with a 3-minute budget (start-up and report included), English, code, English
    again. Not a TTY, so the view
    prints plain lines. How long it took is not a verdict (a loaded machine starts slower); the timeout
    only stops a hung run."""
    out = tmp_path / "report"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "adaptive_eagle_cli", "demo", "--quick", "--out", str(out),
                           "--scenario", "english,code,english",  # a drift and a return
                           "--minutes", "3"],  # make test's time budget (--quick's default is 3.5)
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    output = proc.stdout[-4000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, output
    s = json.loads((out / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(s) and s["failed_requests"] == 0, output
    assert s["requests"] >= 4 and s["drift_accept_length_frozen"] is not None, s
    assert s["replay_check"]["requests"] > 0, s["replay_check"]  # the replay scored the requests it served itself
    log = [json.loads(line) for line in (out / "promotions.jsonl").read_text().splitlines() if line.strip()]
    assert any(e["event"] == "considered" for e in log), (log, s.get("trainer_events"))  # a candidate met the gates
    checks = s["greedy_checks"]
    assert checks["checked"] >= 2 and checks["mismatches"] == 0, checks  # served text == plain greedy decoding
    assert (out / "accept_length.png").stat().st_size > 10_000 and "| after adaptation | code |" in \
        (out / "report.md").read_text()
    assert "accept length by domain" in proc.stdout  # the plain (non-TTY) live view
    figs = s["phase_figures"]  # english came back: its phase is marked returning, and the report has the table
    assert [(f["domain"], f["returning"]) for f in figs] == [("english", False), ("code", False), ("english", True)]
    assert "## Phases" in (out / "report.md").read_text()


def test_every_exactness_check_fails_the_demo_and_is_named():
    """Exit 0 only when every check passed; a differing frozen-head re-decode (lossless decoding) fails too."""
    ok = {"requests": 40, "failed_requests": 0, "greedy_checks": {"mismatches": 0},
          "control": {"frozen_text_differs": 0}, "replay_check": {"requests_differing": 0}}
    assert failed_checks(ok) == []
    assert failed_checks({**ok, "control": {"frozen_text_differs": 2}}) == [
        "2 frozen-head re-decodes differ from the served text (greedy decoding is lossless for any head)"]
    assert failed_checks({**ok, "replay_check": {"requests_differing": 1}, "failed_requests": 3}) == [
        "3 requests failed", "1 requests whose replay differs from what serving measured"]
    assert failed_checks({**ok, "requests": 0}) == ["no request finished"]


def test_the_live_view_draws_a_panel_on_a_terminal_and_lines_elsewhere(tmp_path):
    from rich.console import Console

    from adaptive_eagle_cli.demo.view import LiveStats, LiveView
    from policies.log import PromotionLog

    stats = LiveStats()
    for r in (result(0, 0, "english", 1, by_context=(("512-1k", 3, 3), ("0-512", 2, 2))),
              result(1, 1, "code", 3, 6, 6, "nl-1", by_context=(("512-1k", 6, 0),))):
        stats.add(r)
    assert stats.by_context() == {"0-512": (2.0, 1), "512-1k": (1 + 3 / 9, 2)}  # bucket order, steps pooled
    PromotionLog(tmp_path / "promotions.jsonl").record("considered", candidate="nl-1", champion="v1",
                                                       reason="offline gate on 20 replayed records")
    status = {"state": "training", "records_seen": 2, "tokens_trained": 4096, "loss": 3.2, "candidates": 1,
              "last_candidate": "nl-1"}
    printed = []
    view = LiveView(stats, tmp_path / "promotions.jsonl", lambda: status, lambda: 30.0, lambda t: "code", 0.0,
                    printed.append, tty=False)
    view.start()
    time.sleep(1.5)
    view.close()
    text = "\n".join(printed)
    assert "gate" in text and "considered" in text and "english 2.000" in text and "4,096 tokens trained" in text
    assert "accept length by context: 0-512 2.000 (n=1), 512-1k 1.333 (n=2)" in text
    console = Console(record=True, width=140)
    console.print(view.panel())
    drawn = console.export_text()
    assert "head nl-1" in drawn and "1.000" in drawn and "considered" in drawn
    assert "context 512-1k tokens" in drawn and "1.333" in drawn


def test_the_command_line_leaves_the_default_scenario_to_the_config():
    """`adaptive-eagle demo` with no --scenario runs DemoConfig's default (the agent's tool-set drift), not a
    second default of its own."""
    import inspect

    from adaptive_eagle_cli.demo import demo
    from adaptive_eagle_cli.demo.config import SCENARIOS

    assert inspect.signature(demo).parameters["scenario"].default.default is None
    assert DemoConfig.make(scenario=None).scenario == SCENARIOS["agent"] == ("tools", "tools2")
    assert DemoConfig.make(scenario=None).first_share == 0.5
