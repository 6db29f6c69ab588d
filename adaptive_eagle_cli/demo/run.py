"""The demo as named steps: prompts → stack → control decoder → traffic with the live view → settle →
stop → frozen replay → greedy checks → report.

Owns: the order of the steps, the time budget, the state directory's lifetime and the exit status
(non-zero when a request failed or a sampled response differs from plain greedy decoding). Must not
touch: what each step does (config, traffic, control, view and report own that).
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from adaptive_eagle_cli.demo import control, report
from adaptive_eagle_cli.demo.agent import TOOL_DOMAINS
from adaptive_eagle_cli.demo.config import ENGINE, MODEL_NAME, DemoConfig, demo_stack_config, phase_plan
from adaptive_eagle_cli.demo.phases import phase_figures
from adaptive_eagle_cli.demo.traffic import PromptCycle, Traffic, jsonl_pools, search_passages, sharegpt_pools
from adaptive_eagle_cli.demo.view import LiveStats, LiveView, LogTail


@dataclass(frozen=True)
class DemoOutcome:
    summary: dict
    out: Path
    exit_code: int  # 0: none of failed_checks(summary)


def prompt_pools(cfg: DemoConfig, per_domain: int) -> dict:
    if cfg.prompts is not None:
        return jsonl_pools(cfg.prompts, cfg.seed)
    return sharegpt_pools(tuple(dict.fromkeys(cfg.scenario)), per_domain, cfg.max_prompt_chars, cfg.seed)


def pool_size(cfg: DemoConfig) -> int:
    """Prompts per domain: more than a domain's phase can send, so that no prompt is sent twice (a reused prompt
    could be scored by test-then-train evidence after the trainer learnt its answer). A 2-core machine serves
    about 15 requests a minute; the bound assumes every client sends one a second for the whole run. --quick
    reads fewer (a 3.5-minute smoke run sends a few dozen), but never fewer than its own minutes can send."""
    return max(40 if cfg.quick else 400, int(cfg.minutes * 60 * cfg.clients / (1.0 + cfg.think_s)))


def scenario_of(cfg: DemoConfig, pools: dict) -> tuple[str, ...]:
    """The phases' domains: the scenario's, or with --prompts the file's domains (scenario order first)."""
    if cfg.prompts is None:
        return cfg.scenario
    return tuple([d for d in cfg.scenario if d in pools] + [d for d in pools if d not in cfg.scenario])


def run_demo(cfg: DemoConfig, echo: Callable[[str], None] = print, tty: Optional[bool] = None) -> DemoOutcome:
    from loop.stack import LocalStack

    import torch

    # Ray starts the replica and the trainer with one intra-op thread each (OMP_NUM_THREADS=1); the frozen
    # control decodes here with one as well, so tokens/s compare like for like, and no process spins
    # threads against the others on a small machine.
    torch.set_num_threads(1)
    t_start = time.monotonic()
    out = Path(cfg.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    state = Path(cfg.state_dir).expanduser() if cfg.state_dir else Path(tempfile.mkdtemp(prefix="adaptive-eagle-demo-"))
    echo("loading prompts ...")
    pools = prompt_pools(cfg, pool_size(cfg))
    scenario = scenario_of(cfg, pools)
    stack_cfg = demo_stack_config(cfg, str(state))
    stack = LocalStack(stack_cfg, echo=echo)
    run = None
    try:
        echo("starting the stack (Ray, store, replica, trainer, policy, gateway; loading the target) ...")
        info = stack.start()
        for line in info.lines():
            echo("  " + line)
        run = _serve_and_score(cfg, stack, info, scenario, pools, t_start, echo, tty)
    finally:
        echo(f"stopping the stack ({time.monotonic() - t_start:.0f}s) ...")
        stack.stop()
        if run is None:  # failed or interrupted before the traffic ended: nothing to report
            _drop_state(cfg, state)
    try:
        return _finish(cfg, out, stack_cfg, run, t_start, echo)  # reads the store: the state goes afterwards
    finally:
        _drop_state(cfg, state)


def _drop_state(cfg: DemoConfig, state: Path) -> None:
    if cfg.state_dir is None and not cfg.keep_state:
        shutil.rmtree(state, ignore_errors=True)


@dataclass(frozen=True)
class _Run:
    results: list
    phases: tuple
    control: list
    control_errors: list
    t0: float
    frozen: str
    target: object
    frozen_head: object
    plain_server: object
    trainer_status: Optional[dict]
    trainer_events: list
    log_path: Path
    store: object
    candidate_times: list  # unix seconds at which the trainer wrote each candidate (the registry's `created`)
    prompts_reused: int = 0  # prompts sent a second time (a pool ran out): PromptCycle.reused


def _replica_compute(stack, timeout_s: float = 120.0) -> str:
    """The compute mode the first replica's target runs in (its backend's info), e.g. "float32+fp16-weights"."""
    import asyncio

    status = asyncio.run(asyncio.wait_for(stack.replicas[0].status(), timeout_s))
    compute = status.info.get("compute")
    if not compute:
        raise RuntimeError(f"replica {status.replica} reports no compute mode (backend {status.backend})")
    return compute


def _serve_and_score(cfg, stack, info, scenario, pools, t_start, echo, tty) -> _Run:
    from adaptive_eagle.targets import load_target
    from loop.metrics import candidate_times

    # the greedy checks compare with plain decoding in the replicas' own compute mode: two exact modes round
    # differently (fp32 and fp32+fp16-weights), and a mode measured anew here could differ from theirs
    compute = _replica_compute(stack)
    echo(f"loading the target in this process (frozen-head control, greedy checks) in the replicas' compute mode "
         f"({compute}) ...")
    target = load_target(stack.config.serving.target, device=stack.config.serving.device, compute=compute)
    frozen = info.champion
    frozen_head = stack.registry.load(frozen, target, device=target.device)
    decoder = control.FrozenDecoder(control.decode_server(target, frozen_head, ENGINE), cfg.control_every,
                                    cfg.max_tokens)
    startup = time.monotonic() - t_start
    phases = phase_plan(scenario, cfg.traffic_s(startup), cfg.first_share)
    stats = LiveStats()

    def on_result(r) -> None:
        stats.add(r)
        decoder.offer(r)

    passages = search_passages() if set(scenario) & set(TOOL_DOMAINS) else ()
    traffic = Traffic(info.endpoint, MODEL_NAME, phases, PromptCycle(pools), cfg.clients, cfg.max_tokens, cfg.think_s,
                      on_result, passages=passages)
    view = LiveView(stats, Path(info.promotion_log), lambda: _trainer_status(stack), traffic.elapsed,
                    lambda t: _phase_name(traffic, t), 10.0 if cfg.quick else 20.0, echo, tty)
    echo(f"traffic: {' → '.join(f'{p.domain} {p.end_s - p.start_s:.0f}s' for p in phases)}, {cfg.clients} clients, "
         f"greedy, {cfg.max_tokens} tokens a request (start-up took {startup:.0f}s)")
    traffic.t0 = time.time()
    view.start()
    try:
        traffic.run()
        _settle(cfg, Path(info.promotion_log), t_start, echo)
    except KeyboardInterrupt:
        traffic.stop.set()
        echo("interrupted: finishing the report on what ran")
    finally:
        view.close()
    decoder.close()
    status = _trainer_status(stack, timeout_s=30)
    events = _trainer_events(stack)
    return _Run(stats.snapshot(), phases, list(decoder.samples), list(decoder.errors), traffic.t0, frozen, target,
                frozen_head, control.decode_server(target, None, ENGINE), status, events, Path(info.promotion_log),
                stack.config.store_config, candidate_times(stack.registry), traffic.prompts.reused)



def _phase_name(traffic: Traffic, t: float) -> str:
    i = traffic.phase_at(t)
    return traffic.phases[i].domain if i is not None else "closing"


def _trainer_status(stack, timeout_s: float = 5.0) -> Optional[dict]:
    if stack.trainer is None:
        return None
    import ray

    try:
        return ray.get(stack.trainer.status.remote(), timeout=timeout_s)
    except Exception:  # noqa: BLE001 - a trainer busy in a step answers on the next poll
        return None


def _trainer_events(stack) -> list:
    if stack.trainer is None:
        return []
    import ray

    try:
        return ray.get(stack.trainer.events.remote(200), timeout=30)
    except Exception:  # noqa: BLE001
        return []


def _settle(cfg: DemoConfig, log_path: Path, t_start: float, echo) -> None:
    """--quick: after the traffic, give the trainer (no longer yielding) time to write a candidate and the
    policy time to consider it, within the budget."""
    if not cfg.quick:
        return
    tail = LogTail(log_path)
    deadline = t_start + cfg.budget_s - 30.0
    echo("settling: waiting for the trainer's candidate to reach the gates ...")
    while time.monotonic() < deadline:
        tail.poll()
        if any(e.event == "considered" for e in tail.events):
            time.sleep(2.0)  # let the decision that follows land in the log too
            return
        time.sleep(1.0)
    echo("settling: no candidate reached the gates within the budget")


def _finish(cfg: DemoConfig, out: Path, stack_cfg, run: _Run, t_start: float, echo) -> DemoOutcome:
    echo(f"scoring the frozen head {run.frozen} on the captured records (acceptance replay; "
         f"{time.monotonic() - t_start:.0f}s) ...")
    replays = control.replay_frozen(run.store, run.results, run.target, run.frozen_head, ENGINE)
    echo(f"checking {cfg.greedy_checks} responses against plain greedy decoding ({time.monotonic() - t_start:.0f}s) ...")
    checks = control.greedy_checks(run.plain_server, run.results, cfg.greedy_checks, cfg.max_tokens)
    tail = LogTail(run.log_path)
    tail.poll()
    rows = report.table(run.results, run.phases, replays, run.control)
    if run.prompts_reused:
        echo(f"note: {run.prompts_reused} prompts were sent a second time (a domain's pool ran out); test-then-train "
             "evidence may have scored them after training on their first answer")
    extra = {"frozen_head": run.frozen, "replayed_requests": len(replays), "prompts_reused": run.prompts_reused,
             "replay_check": report.replay_check(run.results, replays, run.frozen), "trainer": run.trainer_status,
             "trainer_events": run.trainer_events[-40:], "control_errors": run.control_errors,
             "phases": [p.__dict__ for p in run.phases], "duration_s": round(time.monotonic() - t_start, 1),
             "phase_figures": phase_figures(run.results, run.phases, replays, [
                 (report.event_seconds(e, run.t0), e.candidate) for e in tail.events if e.event == "promoted"],
                 gates={e.candidate: e.evidence for e in tail.events if e.event == "canary_started"})}
    s = report.summary(rows, run.results, tail.events, checks, run.control,
                       {**report.time_to_adapt(
                           run.phases, run.t0, run.candidate_times, tail.events, rows,
                           lambda v: report.helped_drifted_domain(run.results, replays, run.phases, v)), **extra})
    info = {"when": time.strftime("%Y-%m-%d %H:%M"), "duration_s": extra["duration_s"],
            "target": stack_cfg.serving.target, "frozen_head": run.frozen, "scenario": [p.domain for p in run.phases],
            "clients": cfg.clients, "max_tokens": cfg.max_tokens,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
            "config": {"demo": cfg.model_dump(mode="json"), "engine": ENGINE,
                       "trainer": stack_cfg.trainer.inner_fields(), "policy": stack_cfg.policy.inner_fields()}}
    report.write(out, s, rows, tail.events, info, run.log_path,
                 {"results": run.results, "counts": replays, "phases": run.phases, "events": tail.events,
                  "t0": run.t0, "title": f"accept length per domain: adapted stack vs frozen {run.frozen}",
                  "note": report.adapt_line(s)})
    return DemoOutcome(s, out, 1 if failed_checks(s) else 0)


def failed_checks(s: dict) -> list[str]:
    """The demo's checks that failed, each named with its count (empty: exit 0). Replay exactness is among them:
    the frozen column and the gate's test-then-train evidence are replays, so on the requests the frozen head
    served itself a replay must give the accept lengths serving gave, else neither can be trusted."""
    checks = [("requests", s["requests"] == 0, "no request finished"),
              ("failed", s["failed_requests"], "requests failed"),
              ("greedy", s["greedy_checks"]["mismatches"], "sampled responses differ from plain greedy decoding"),
              ("control", s["control"]["frozen_text_differs"],
               "frozen-head re-decodes differ from the served text (greedy decoding is lossless for any head)"),
              ("replay", s["replay_check"]["requests_differing"],
               "requests whose replay differs from what serving measured"),
              ("tool calls", _invalid_required(s), "agent turns under tool_choice required without exactly one valid "
                                                    "call (the call's grammar promises one)")]
    return [f"{int(n)} {what}" if n is not True else what for _, n, what in checks if n]


def _invalid_required(s: dict) -> int:
    c = (s.get("tool_calls") or {}).get("required")
    return c["turns"] - c["valid"] if c else 0


__all__ = ["DemoOutcome", "failed_checks", "pool_size", "prompt_pools", "run_demo", "scenario_of"]
