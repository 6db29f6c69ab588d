"""bench/rehearsal.py's pure parts: the rehearsal config is ops/prod.yaml with host settings replaced and counts
scaled by the one factor (and the stack's own check accepts it); per-replica counters survive a replica restart;
a gate decision on evidence replayed against another champion is counted as stale."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import yaml

from bench.rehearsal import CaptureCounter, _gate_power, _stale_gate_decisions, rehearsal_config
from policies.log import PromotionEvent
from loop.check import check_stack
from loop.config import parse_stack_config

PROD = Path(__file__).resolve().parents[2] / "ops" / "prod.yaml"
ENV = {"AE_ADMIN_TOKEN": "a" * 32, "AE_API_KEY": "k" * 32, "AE_REDIS_HOST": "localhost", "AE_REDIS_PASSWORD": "pw"}


def _redis(tmp_path):
    return SimpleNamespace(url="rediss://localhost:7000/0", password="pw", ca_file=str(tmp_path / "ca.crt"))


def test_the_rehearsal_config_is_prod_with_host_settings_replaced_and_counts_scaled(tmp_path):
    data, replaced, scaled = rehearsal_config(PROD, 0.05, tmp_path / "state", _redis(tmp_path), ENV)
    cfg = parse_stack_config(data, "rehearsal")
    check = check_stack(cfg, serving_target=True)
    assert not check.problems, check.problems
    prod = yaml.safe_load(PROD.read_text())
    # the sample minimums: prod's 400 times the factor; the policy's other settings stay prod's
    assert cfg.policy.min_samples == 20 == prod["policy"]["min_samples"] * 0.05
    assert cfg.policy.canary_min_requests == 20 and cfg.policy.canary_fraction == prod["policy"]["canary_fraction"]
    assert cfg.policy.canary_health_requests == 5 == prod["policy"]["canary_health_requests"] * 0.05
    assert cfg.policy.canary_mode == prod["policy"]["canary_mode"] == "auto"
    assert cfg.trainer.candidate_every_minutes == prod["trainer"]["candidate_every_minutes"] * 0.05
    assert cfg.serving.capture.fraction == 1.0  # 0.05 / 0.05: fewer requests, a larger share captured
    # host settings: a local store over TLS, reference replicas with SGLang's tree, no GPUs, no cluster
    assert cfg.store.redis_url.startswith("rediss://localhost:") and cfg.store.tls
    assert cfg.serving.backend == "reference" and cfg.serving.engine.depth == prod["serving"]["sglang"]["num_steps"]
    assert cfg.ray.address is None and cfg.ray.replica_num_gpus == 0 and cfg.trainer.num_gpus == 0
    assert cfg.serving.replicas == prod["serving"]["replicas"]  # as many replicas as production
    assert any(line.startswith("policy.min_samples: 400 -> 20") for line in scaled)
    assert all(ENV["AE_ADMIN_TOKEN"] not in line and ENV["AE_API_KEY"] not in line for line in replaced + scaled)
    assert cfg.serving.admin_token.get_secret_value() == ENV["AE_ADMIN_TOKEN"]  # secrets come from the environment


def test_a_replica_restart_does_not_lose_its_counts():
    c = CaptureCounter()
    assert c.update("ae_capture_written", {'ae_capture_written{replica="a"}': 5.0}) == 5.0
    assert c.update("ae_capture_written", {'ae_capture_written{replica="a"}': 9.0,
                                           'ae_capture_written{replica="b"}': 1.0}) == 10.0
    assert c.update("ae_capture_written", {'ae_capture_written{replica="a"}': 2.0}) == 12.0  # restarted: from 0


def test_stale_gate_decisions_use_the_champion_each_candidate_was_replayed_against():
    reg = SimpleNamespace(versions=lambda: [
        SimpleNamespace(version="nl-1", metrics={"replay": {"champion_version": "v1"}}),
        SimpleNamespace(version="nl-2", metrics={"replay": {"champion_version": "v1"}}),
        SimpleNamespace(version="nl-3", metrics={"replay": {"champion_version": "nl-1"}})])
    events = [
        PromotionEvent(event="canary_started", candidate="nl-1", champion="v1"),
        PromotionEvent(event="promoted", candidate="nl-1", champion="v1"),
        # nl-2 was replayed against v1, the champion is nl-1 now: the guard refuses it (not stale) ...
        PromotionEvent(event="rejected", candidate="nl-2", champion="nl-1", reason="stale evidence: ..."),
        PromotionEvent(event="canary_started", candidate="nl-3", champion="nl-1"),
    ]
    assert _stale_gate_decisions(events, reg) == {"stale": 0, "refused": 1}
    # ... a gate that judged it anyway is a stale decision
    events.append(PromotionEvent(event="rejected", candidate="nl-2", champion="nl-1", reason="offline gate: ...",
                                 evidence={"n": 20}))
    assert _stale_gate_decisions(events, reg) == {"stale": 1, "refused": 1}


def test_the_gate_power_of_a_run_is_what_its_closing_decisions_could_have_shown():
    """The full rehearsal requires a promotion only when some offline gate decision could have promoted a head
    (bench/rehearsal.py _gate_power): decisions on windows too short to bet on leave it unclaimed."""
    def rejected(n, gain):
        return PromotionEvent(event="rejected", candidate=f"nl-{n}", champion="v1", reason="offline gate: ...",
                              evidence={"gate": "offline_sequential", "n": n, "detectable_tail_gain": gain})

    short = [rejected(22, None), rejected(28, None), PromotionEvent(event="considered", candidate="nl-9")]
    assert _gate_power(short) == {"records_max": 28, "smallest": None}
    assert _gate_power(short + [rejected(900, 0.31), rejected(1500, 0.12)]) == {"records_max": 1500, "smallest": 0.12}


def test_trainer_recovery_counts_from_the_fault_taking_effect_to_a_step_of_the_new_process():
    from bench.rehearsal import Watcher

    w = Watcher.__new__(Watcher)  # only its history is needed
    w.trainer_seen = [(1, {"pid": 1, "state": "training", "last_step_at": 0.5}),
                      (5, {"pid": 1, "state": "evaluating", "last_step_at": 0.5}),  # the armed step comes later
                      (50, {"pid": 1, "state": "error: InjectedFault: x"}), (52, None),
                      (60, {"pid": 2, "state": "starting"}), (70, {"pid": 2, "state": "waiting", "last_step_at": 69})]
    assert w.trainer_recovered(2, 1) == 20  # 50 s (the step raised) -> 70 s (the new process stepped)
    assert Watcher.trainer_recovered(w, 80, 2) is None  # nothing went down after 80 s
