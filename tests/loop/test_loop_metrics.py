"""The loop's metrics (loop/metrics.py) from plain readers and a simulated clock: states reduced to one
label, ages computed at scrape time, a part that stops answering shown as unreachable and counted (never its
last good value), the promotion log followed as it grows (its newest event and newest promotion), and the drift signal per
domain."""

from prometheus_client import CollectorRegistry, generate_latest

from policies.log import PromotionLog
from loop.metrics import LoopCollector, LoopWatcher, PromotionLogFollower, trainer_state_class
from trainer.drift import DriftMonitor


class Clock:
    def __init__(self):
        self.now = 1_000_000.0

    def __call__(self):
        return self.now


def scrape(watcher) -> dict[str, float]:
    reg = CollectorRegistry()
    reg.register(LoopCollector(watcher))
    out = {}
    for line in generate_latest(reg).decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_trainer_states_reduce_to_one_label():
    assert trainer_state_class("degraded since 2026-12-01T12:00:00Z: StoreUnavailable: down") == "degraded"
    assert trainer_state_class("error: RuntimeError: boom") == "error"
    assert trainer_state_class("training") == "training" and trainer_state_class(None) == "unreachable"
    assert trainer_state_class("something new") == "error"  # an unknown state never reads healthy


def test_ages_grow_at_scrape_time_and_a_silent_trainer_is_unreachable(tmp_path):
    clock = Clock()
    status = {"state": "training", "last_step_at": clock.now - 5, "errors_total": 2, "records_seen": 40, "pid": 100}
    answering = {"on": True}

    def trainer():
        if not answering["on"]:
            raise TimeoutError("the trainer actor did not answer in 10 s")
        return status

    w = LoopWatcher(trainer_status=trainer, candidate_time=lambda: clock.now - 60,
                    last_event=lambda: {"event": "promoted", "candidate": "nl-3", "action": "promote",
                                        "at": clock.now - 30},
                    policy_running=lambda: True, clock=clock)
    w.poll()
    m = scrape(w)
    assert m["ae_trainer_healthy"] == 1.0 and m['ae_trainer_state{state="training"}'] == 1.0
    assert m["ae_trainer_last_step_age_seconds"] == 5.0 and m["ae_trainer_errors"] == 2.0
    assert m["ae_candidate_last_age_seconds"] == 60.0 and m["ae_policy_running"] == 1.0
    assert m['ae_policy_last_decision{action="promote",candidate="nl-3",event="promoted"}'] == 1.0
    clock.now += 100  # nothing polled since: ages still grow
    assert scrape(w)["ae_trainer_last_step_age_seconds"] == 105.0
    answering["on"] = False
    w.poll()
    m = scrape(w)
    assert m["ae_trainer_healthy"] == 0.0 and m['ae_trainer_state{state="unreachable"}'] == 1.0
    assert m['ae_loop_poll_errors{part="trainer"}'] == 1.0
    answering["on"], status["state"] = True, "degraded since 2026-12-01T12:00:00Z: StoreUnavailable: redis down"
    w.poll()
    m = scrape(w)
    assert m["ae_trainer_healthy"] == 0.0 and m['ae_trainer_state{state="degraded"}'] == 1.0
    assert m["ae_trainer_restarts_total"] == 0.0  # unreachable, then the same process again: no restart
    status["pid"] = 101  # Ray restarted the actor: a new process answers
    w.poll()
    w.poll()
    assert scrape(w)["ae_trainer_restarts_total"] == 1.0


def test_no_trainer_reads_off_and_the_log_follower_gives_the_newest_event_and_promotion(tmp_path):
    path = tmp_path / "promotions.jsonl"
    follow = PromotionLogFollower(path)
    assert follow() is None  # no log yet; nothing created
    assert not path.exists()
    log = PromotionLog(path)
    log.record("promoted", candidate="nl-0", champion="v1", action="promote", reason="every replica serves nl-0")
    log.record("considered", candidate="nl-1", champion="nl-0", reason="offline gate on 20 replayed records")
    log.record("rejected", candidate="nl-1", champion="nl-0", action="reject", reason="no tail gain")
    with open(path, "a") as f:
        f.write('{"torn": ')  # a line still being written waits for its end
    e = follow()
    assert (e["event"], e["candidate"], e["action"]) == ("rejected", "nl-1", "reject") and e["at"] > 0
    assert e["promoted"] == "nl-0" and 0 < e["promoted_at"] <= e["at"]
    with open(path, "a") as f:
        f.write('"line"}\n')  # the torn line ends corrupt: skipped, and the newest event stays
    assert follow()["event"] == "rejected"
    log.record("considered", candidate="nl-2", champion="nl-0", reason="offline gate on 30 replayed records")
    e = follow()  # only the appended lines are read, and the promotion far back is still known
    assert (e["event"], e["candidate"], e["promoted"]) == ("considered", "nl-2", "nl-0")
    path.write_text("")  # replaced by an empty log: nothing is known any more
    assert follow() is None
    w = LoopWatcher(trainer_status=None, candidate_time=lambda: None, last_event=follow,
                    policy_running=lambda: False)
    w.poll()
    m = scrape(w)
    assert m['ae_trainer_state{state="off"}'] == 1.0 and "ae_trainer_last_step_age_seconds" not in m
    assert "ae_candidate_last_age_seconds" not in m and m["ae_policy_running"] == 0.0
    assert "ae_last_promotion_age_seconds" not in m


def test_time_since_the_last_promotion_and_the_drift_signal_per_domain():
    clock = Clock()
    drift = DriftMonitor(alpha=0.5, drop=0.1, min_records=3, sustain=2)
    for x in (2.0, 2.0, 2.0):
        drift.observe("english", x, "v1")
    for x in (2.0, 2.0, 2.0, 1.2, 1.2, 1.2):
        drift.observe("code", x, "v1")
    status = {"state": "training", "pid": 1, "drift": drift.table()}
    w = LoopWatcher(trainer_status=lambda: status, candidate_time=lambda: None,
                    last_event=lambda: {"event": "considered", "candidate": "nl-2", "action": None, "at": clock.now,
                                        "promoted_at": clock.now - 600, "promoted": "nl-1"},
                    policy_running=lambda: True, clock=clock)
    w.poll()
    clock.now += 5
    m = scrape(w)
    assert m["ae_last_promotion_age_seconds"] == 605.0
    assert m['ae_drift_flagged{domain="code"}'] == 1.0 and m['ae_drift_flagged{domain="english"}'] == 0.0
    assert m['ae_drift_accept_length{domain="code"}'] < 0.9 * m['ae_drift_reference_accept_length{domain="code"}']
    assert m['ae_drift_reference_accept_length{domain="english"}'] == 2.0


def test_test_then_train_evidence_and_refused_evidence_files_show_in_the_metrics():
    clock = Clock()
    status = {"state": "evaluating", "pid": 1, "evidence_rows": 42,
              "gathering": [{"version": "nl-1", "records": 30}, {"version": "nl-2", "records": 12}]}
    w = LoopWatcher(trainer_status=lambda: status, candidate_time=lambda: None, last_event=lambda: None,
                    policy_running=lambda: True, feed=lambda: {"refused": 1, "looks": 7, "gathering": 2}, clock=clock)
    w.poll()
    m = scrape(w)
    assert m["ae_trainer_evidence_rows"] == 42.0 and m["ae_candidates_gathering_evidence"] == 2.0
    assert m["ae_candidate_evidence_refused_total"] == 1.0 and m["ae_candidate_evidence_looks_total"] == 7.0
    assert m["ae_trainer_healthy"] == 1.0  # evaluating (replaying evidence) is a healthy state
