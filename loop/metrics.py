"""What on-call needs to see of the loop beyond the servers: is the trainer stepping, when did it last write a
candidate, what did the policy last decide. The stack polls the parts (the trainer actor's status, the head
registry, the promotion log) on a thread of its own and the gateway's /metrics exports the latest snapshot,
with ages computed at scrape time, so a part that stops answering shows as stale or unreachable, never as the
last good value.

Owns: `LoopWatcher` (the poller and its snapshot) and `LoopCollector` (the Prometheus families). Must not
touch: the parts themselves (it only reads them), request handling. A poll that fails is counted and shown
(`ae_loop_poll_errors`), never raised: /metrics keeps answering.

Metrics (every gauge; ages in seconds):
    ae_trainer_healthy                  1 while the trainer's loop runs (training or waiting for traffic);
                                        0 when degraded (retrying the store), in error, stopped or unreachable
    ae_trainer_state{state}             1 for the trainer's state: training | waiting | evaluating | starting |
                                        degraded | error | stopped | unreachable | off
    ae_trainer_errors                   errors the trainer's loop met (store errors ridden out, a fatal one)
    ae_trainer_last_step_age_seconds    since the trainer's last optimizer step (since the stack started when
                                        it has not stepped yet)
    ae_trainer_records_seen             records the trainer has read from the store
    ae_trainer_records_aged_to_replay   records that waited past trainer.max_fresh_age_s for a step (the trainer
                                        is behind the traffic) and went to the replay buffer instead
    ae_trainer_rows_replayed            replay rows the trainer has trained (trainer.replay_ratio of the rows, on
                                        long sessions paid by steps on replay alone)
    ae_trainer_restarts_total           trainer processes that replaced an earlier one (Ray restarted the actor
                                        after its process ended: a crash, a fatal loop error, a kill), counted
                                        from the first status with a new pid since the gateway started
    ae_candidate_last_age_seconds       since the newest candidate the trainer wrote (absent: none yet)
    ae_policy_running                   1 while the policy's loop runs
    ae_policy_last_decision_age_seconds since the promotion log's newest event
    ae_policy_last_decision{event,candidate,action}  1 for that event
    ae_last_promotion_age_seconds       since the newest promotion in the promotion log (absent: none yet)
    ae_drift_accept_length{domain}      the trainer's drift signal: live accept length per domain (EWMA of
                                        served records under the current champion)
    ae_drift_reference_accept_length{domain}  what that level is compared with (absent until enough records)
    ae_drift_flagged{domain}            1 while the domain stays below its reference by the drift margin
    ae_loop_poll_errors{part}           polls of a part that failed
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

log = logging.getLogger(__name__)
TRAINER_STATES = ("training", "waiting", "evaluating", "starting", "degraded", "error", "stopped", "unreachable",
                  "off")


def trainer_state_class(state: Optional[str]) -> str:
    """The trainer's state string ("degraded since ...: ...", "error: ...") reduced to one of TRAINER_STATES."""
    if state is None:
        return "unreachable"
    head = state.split(" ", 1)[0].rstrip(":")
    return head if head in TRAINER_STATES else "error"


@dataclass
class LoopSnapshot:
    started_at: float
    trainer: Optional[dict] = None  # the trainer's status dict; None: off or not answering
    trainer_enabled: bool = False
    candidate_at: Optional[float] = None  # unix seconds of the newest trainer-written version
    last_event: Optional[dict] = None  # the promotion log's newest event (event, candidate, action, at)
    policy_running: bool = False
    poll_errors: dict = field(default_factory=dict)  # part -> failed polls
    trainer_restarts: int = 0  # the trainer answered from a new process
    feed: Optional[dict] = None  # the candidate feed's counts (refused evidence files, sequential looks)


class LoopWatcher:
    """Polls the loop's parts every `every_s` seconds on its own thread (`start`/`stop`); `snapshot()` is the
    latest. Each reader is a plain callable: trainer_status() -> dict (raises when the trainer does not answer),
    candidate_time() -> unix seconds or None, last_event() -> dict or None, policy_running() -> bool."""

    def __init__(self, *, trainer_status: Optional[Callable[[], dict]], candidate_time: Callable[[], Optional[float]],
                 last_event: Callable[[], Optional[dict]], policy_running: Callable[[], bool],
                 feed: Optional[Callable[[], dict]] = None, every_s: float = 5.0,
                 clock: Callable[[], float] = time.time) -> None:
        self._readers = {"trainer": trainer_status, "registry": candidate_time, "promotion_log": last_event,
                         "policy": policy_running, "feed": feed}
        self.every_s, self.clock = every_s, clock
        self._snap = LoopSnapshot(started_at=clock(), trainer_enabled=trainer_status is not None)
        self._lock = threading.Lock()
        self._failing: set[str] = set()
        self._trainer_pid: Optional[int] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def poll(self) -> LoopSnapshot:
        """Read every part once; a part that fails keeps no stale value (the trainer shows as unreachable)."""
        values, errors = {}, {}
        for part, read in self._readers.items():
            if read is None:
                continue
            try:
                values[part] = read()
                if part in self._failing:
                    self._failing.discard(part)
                    log.info("loop metrics: the %s answers again", part)
            except Exception as e:  # noqa: BLE001 - shown in the metrics, never raised into /metrics
                errors[part] = 1
                values[part] = None
                if part not in self._failing:  # logged when it starts failing; every failure is counted
                    self._failing.add(part)
                    log.warning("loop metrics: reading the %s failed: %s: %s", part, type(e).__name__, e)
        with self._lock:
            s = self._snap
            for part, n in errors.items():
                s.poll_errors[part] = s.poll_errors.get(part, 0) + n
            trainer = values.get("trainer")
            pid = (trainer or {}).get("pid")
            if pid is not None:
                if self._trainer_pid is not None and pid != self._trainer_pid:
                    s.trainer_restarts += 1
                    log.warning("loop metrics: the trainer answers from a new process (pid %s, was %s): it restarted",
                                pid, self._trainer_pid)
                self._trainer_pid = pid
            s.trainer = trainer
            s.candidate_at = values.get("registry")
            s.last_event = values.get("promotion_log")
            s.policy_running = bool(values.get("policy"))
            s.feed = values.get("feed")
            return self.snapshot()

    def snapshot(self) -> LoopSnapshot:
        s = self._snap
        return LoopSnapshot(s.started_at, dict(s.trainer) if s.trainer else None, s.trainer_enabled, s.candidate_at,
                            dict(s.last_event) if s.last_event else None, s.policy_running, dict(s.poll_errors),
                            s.trainer_restarts, dict(s.feed) if s.feed else None)

    def start(self) -> None:
        self.poll()
        self._thread = threading.Thread(target=self._run, name="loop-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.poll()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)


def candidate_times(registry) -> list[float]:
    """Unix seconds at which the near-line trainer wrote each of its versions in `registry`, oldest first."""
    import datetime

    return sorted(datetime.datetime.fromisoformat(v.created.replace("Z", "+00:00")).timestamp()
                  for v in registry.versions() if (v.training or {}).get("trainer") == "nearline")


def newest_candidate_time(registry) -> Optional[float]:
    """Unix seconds of the newest version the near-line trainer wrote into `registry` (None: none yet)."""
    times = candidate_times(registry)
    return times[-1] if times else None


def _log_event(line: str) -> Optional[dict]:
    """One promotion-log line as {event, candidate, action, at}; None for a torn or corrupt line."""
    import datetime

    from policies.log import PromotionEvent

    try:
        e = PromotionEvent.model_validate_json(line)
    except ValueError:
        return None
    at = datetime.datetime.fromisoformat(e.time.replace("Z", "+00:00")).timestamp()
    return {"event": e.event, "candidate": e.candidate, "action": e.action, "at": at}


class PromotionLogFollower:
    """Follows the promotion log as it grows: each call reads only the lines appended since the last one and
    returns the newest event as {event, candidate, action, at}, plus `promoted_at` and `promoted`: the time
    and version of the newest promotion ever logged (absent before the first), however far back it is. A
    log that shrank (replaced, rotated) is read again from its start; a torn last line waits for its end."""

    def __init__(self, path) -> None:
        self.path = path
        self._offset = 0
        self._newest: Optional[dict] = None
        self._promoted: Optional[dict] = None

    def __call__(self) -> Optional[dict]:
        import os

        try:
            with open(self.path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                if size < self._offset:  # a new file: start over
                    self._offset, self._newest, self._promoted = 0, None, None
                f.seek(self._offset)
                data = f.read(size - self._offset)
        except FileNotFoundError:
            return None
        end = data.rfind(b"\n") + 1  # whole lines only; a line still being written is read next time
        self._offset += end
        for raw in data[:end].splitlines():
            e = _log_event(raw.decode("utf-8", "replace"))
            if e is None:
                continue
            self._newest = e
            if e["event"] == "promoted":
                self._promoted = e
        if self._newest is None:
            return None
        out = dict(self._newest)
        if self._promoted is not None:
            out.update(promoted_at=self._promoted["at"], promoted=self._promoted["candidate"])
        return out


class LoopCollector:
    """A prometheus_client collector over a LoopWatcher (register it on the gateway's registry)."""

    def __init__(self, watcher: LoopWatcher) -> None:
        self.watcher = watcher

    def describe(self):
        return []  # families are built at collect time; nothing to pre-register

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s, now = self.watcher.snapshot(), self.watcher.clock()
        state = "off" if not s.trainer_enabled else trainer_state_class(s.trainer.get("state") if s.trainer else None)
        yield GaugeMetricFamily("ae_trainer_healthy", "1 while the trainer's loop runs; 0 when degraded, in error, "
                                "stopped or unreachable", value=float(state in ("training", "waiting", "evaluating",
                                                                                "starting")))
        states = GaugeMetricFamily("ae_trainer_state", "1 for the trainer's current state", labels=["state"])
        for name in TRAINER_STATES:
            states.add_metric([name], float(name == state))
        yield states
        t = s.trainer or {}
        yield GaugeMetricFamily("ae_trainer_errors", "Errors the trainer's loop met (this process)",
                                value=float(t.get("errors_total") or 0))
        yield GaugeMetricFamily("ae_trainer_records_seen", "Records the trainer has read from the store",
                                value=float(t.get("records_seen") or 0))
        yield GaugeMetricFamily("ae_trainer_evidence_rows", "Test-then-train evidence rows the trainer wrote (this "
                                "process): records replayed by the champion and a candidate before training on them",
                                value=float(t.get("evidence_rows") or 0))
        yield GaugeMetricFamily("ae_candidates_gathering_evidence", "Candidate snapshots whose test-then-train "
                                "evidence is still growing", value=float(len(t.get("gathering") or ())))
        if s.feed is not None:
            yield CounterMetricFamily("ae_candidate_evidence_refused", "Candidates whose evidence the policy refused "
                                      "(a malformed evidence file or head.json replay block; named in the log), "
                                      "never considered", value=float(
                                          s.feed.get("refused", 0)))
            yield CounterMetricFamily("ae_candidate_evidence_looks", "Looks of the sequential offline gate at "
                                      "growing test-then-train evidence", value=float(s.feed.get("looks", 0)))
        yield GaugeMetricFamily("ae_trainer_records_aged_to_replay", "Records that waited longer than "
                                "trainer.max_fresh_age_s for a step (the trainer is behind the traffic) and went to "
                                "the replay buffer instead", value=float(t.get("aged_to_replay") or 0))
        yield GaugeMetricFamily("ae_trainer_rows_replayed", "Replay rows the trainer has trained (trainer.replay_ratio "
                                "of the rows; on long sessions paid by steps on replay alone)",
                                value=float(t.get("rows_replayed") or 0))
        if s.trainer_enabled:
            yield CounterMetricFamily("ae_trainer_restarts", "Trainer processes that replaced an earlier one (Ray "
                                      "restarted the actor) since the gateway started", value=float(s.trainer_restarts))
            stepped = t.get("last_step_at") or s.started_at
            yield GaugeMetricFamily("ae_trainer_last_step_age_seconds", "Seconds since the trainer's last step",
                                    value=max(0.0, now - float(stepped)))
        if s.candidate_at is not None:
            yield GaugeMetricFamily("ae_candidate_last_age_seconds", "Seconds since the newest candidate",
                                    value=max(0.0, now - s.candidate_at))
        yield GaugeMetricFamily("ae_policy_running", "1 while the policy's loop runs", value=float(s.policy_running))
        if s.last_event is not None:
            yield GaugeMetricFamily("ae_policy_last_decision_age_seconds", "Seconds since the promotion log's newest "
                                    "event", value=max(0.0, now - float(s.last_event.get("at") or now)))
            info = GaugeMetricFamily("ae_policy_last_decision", "1 for the promotion log's newest event",
                                     labels=["event", "candidate", "action"])
            e = s.last_event
            info.add_metric([str(e.get("event") or ""), str(e.get("candidate") or ""), str(e.get("action") or "")], 1.0)
            yield info
        if s.last_event is not None and s.last_event.get("promoted_at") is not None:
            yield GaugeMetricFamily("ae_last_promotion_age_seconds", "Seconds since the promotion log's newest "
                                    "promotion", value=max(0.0, now - float(s.last_event["promoted_at"])))
        drift = (t.get("drift") or {}) if s.trainer_enabled else {}
        if drift:
            level = GaugeMetricFamily("ae_drift_accept_length", "Live accept length per domain (the trainer's "
                                      "EWMA over served records, under the current champion)", labels=["domain"])
            ref = GaugeMetricFamily("ae_drift_reference_accept_length", "The level a domain's live accept length "
                                    "is compared with (the higher of its own and the overall baseline)",
                                    labels=["domain"])
            flagged = GaugeMetricFamily("ae_drift_flagged", "1 while a domain's live accept length stays below its "
                                        "reference by the drift margin (the trainer weights it up)", labels=["domain"])
            for domain, row in sorted(drift.items()):
                level.add_metric([domain], float(row.get("ewma") or 0.0))
                if row.get("reference") is not None:
                    ref.add_metric([domain], float(row["reference"]))
                flagged.add_metric([domain], float(bool(row.get("flagged"))))
            yield level
            yield ref
            yield flagged
        errors = GaugeMetricFamily("ae_loop_poll_errors", "Polls of a loop part that failed", labels=["part"])
        for part, n in sorted(s.poll_errors.items()):
            errors.add_metric([part], float(n))
        yield errors


__all__ = ["LoopCollector", "LoopSnapshot", "LoopWatcher", "PromotionLogFollower", "TRAINER_STATES", "candidate_times",
           "newest_candidate_time",
           "trainer_state_class"]
