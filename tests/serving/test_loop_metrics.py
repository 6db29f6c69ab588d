"""The loop's metrics (serving/loop_metrics.py) from plain readers and a simulated clock: states reduced to one
label, ages computed at scrape time, a part that stops answering shown as unreachable and counted (never its
last good value), and the promotion log's newest event read from the file's tail."""

from prometheus_client import CollectorRegistry, generate_latest

from policies.log import PromotionLog
from serving.loop_metrics import LoopCollector, LoopWatcher, newest_log_event, trainer_state_class


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


def test_no_trainer_reads_off_and_the_log_tail_gives_the_newest_event(tmp_path):
    path = tmp_path / "promotions.jsonl"
    assert newest_log_event(path) is None  # no log yet; nothing created
    assert not path.exists()
    log = PromotionLog(path)
    log.record("considered", candidate="nl-1", champion="v1", reason="offline gate on 20 replayed records")
    log.record("rejected", candidate="nl-1", champion="v1", action="reject", reason="no tail gain")
    with open(path, "a") as f:
        f.write('{"torn": ')  # a torn last line is skipped for the one before it
    e = newest_log_event(path)
    assert (e["event"], e["candidate"], e["action"]) == ("rejected", "nl-1", "reject") and e["at"] > 0
    w = LoopWatcher(trainer_status=None, candidate_time=lambda: None, last_event=lambda: newest_log_event(path),
                    policy_running=lambda: False)
    w.poll()
    m = scrape(w)
    assert m['ae_trainer_state{state="off"}'] == 1.0 and "ae_trainer_last_step_age_seconds" not in m
    assert "ae_candidate_last_age_seconds" not in m and m["ae_policy_running"] == 0.0
