"""Writer side: a non-blocking `put()` for servers, a bounded queue and a background flusher.

Owns: the queue, the flusher thread, drop/opt-out accounting, the writer's state and its backoff. Must not
touch: the caller's request: `put()` never blocks on I/O and never raises; when the store is slow, down or
refusing, records are dropped and counted (`dropped`, and by reason in `dropped_by_reason`, see
DROP_REASONS), requests that opted out are counted (`opted_out`) and never stored. Records are encoded
(codec + Arrow IPC) on the flusher thread, not the caller's.

The flusher never dies of a store error. Its state (`WriterStats.state`, see WRITER_STATES):
  ok       -> writes go through.
  down     -> the store cannot be reached (StoreUnavailable, OSError): records wait in the queue, the
              flusher pings after each backoff (doubling up to backoff_max_s) and writes again once it answers.
  erroring -> the store answered but refused (StoreRejected: OOM, READONLY, NOAUTH, NOPERM), or the backend
              raised something unexpected: after each backoff the flusher writes one record as the probe
              (a PING succeeds under OOM or READONLY, so only a write proves writes work) and returns to ok
              when the store takes it.
  dead     -> a bug killed the flusher thread anyway; stats() says so, with the error, and put() drops.
`last_error` keeps the latest failure with its UTC time, also after recovery.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from adaptive_eagle.trace import TraceRecord
from feature_store.backend import Backend, StoreRejected, StoreUnavailable, open_backend
from feature_store.config import StoreConfig
from feature_store.schema import encode_record

log = logging.getLogger(__name__)
COUNTER_PUBLISH_S = 1.0
MAINTAIN_S = 30.0
ERROR_CHARS = 500

DROP_REASONS = {  # every record the writer does not store is counted under exactly one of these
    "queue_full": "put() refused: the queue was at queue_max_records or queue_max_bytes",
    "closed": "put() after close(), or still queued when close() stopped waiting",
    "bad_record": "put() could not size the record (not a TraceRecord)",
    "encode_error": "the flusher could not encode the record (codec, schema)",
    "store_down": "its write failed because the store could not be reached (StoreUnavailable, OSError)",
    "rejected": "the store answered and refused its write (StoreRejected: OOM, READONLY, NOAUTH, NOPERM)",
    "write_error": "the backend raised something unexpected on its write (a bug; handled like a refusal)",
    "flusher_dead": "queued, in flight or put() after a bug killed the flusher thread",
}
WRITER_STATES = {
    "ok": "the last write (or reconnect ping) succeeded",
    "down": "the store cannot be reached; the flusher pings it after each backoff",
    "erroring": "the store answered but refused the last write; the flusher probes with one record per backoff",
    "dead": "a bug killed the flusher thread; nothing more is written",
}


@dataclass(frozen=True)
class WriterStats:
    accepted: int  # put() calls that queued a record
    written: int  # records the backend acknowledged
    dropped: int  # records not stored, for any reason: the sum of dropped_by_reason
    opted_out: int  # capture_consent False: never stored (not a drop)
    queued: int
    queued_bytes: int
    state: str  # one of WRITER_STATES
    connected: bool  # the store answered the last time the flusher reached for it (False only when "down")
    backoff_s: float  # current retry delay while down or erroring (0 when ok)
    last_error: str | None = None  # "<UTC time> <reason>: <error>" of the latest failure, kept after recovery
    dropped_by_reason: dict[str, int] = field(default_factory=dict)  # every key of DROP_REASONS


def _stamped(error: str) -> str:
    return f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {error[:ERROR_CHARS]}"


class StoreWriter:
    def __init__(self, config: StoreConfig, backend: Backend | None = None):
        self.cfg = config
        self._own_backend = backend is None
        self.backend = backend if backend is not None else open_backend(config)
        self._q: deque[tuple[TraceRecord, int]] = deque()
        self._q_bytes = 0
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._stop = False
        self._stopping = threading.Event()  # wakes a backoff sleep on close()
        self._c = {"accepted": 0, "written": 0, "opted_out": 0}
        self._drops = dict.fromkeys(DROP_REASONS, 0)
        self._published = {"dropped": 0, "opted_out": 0, "written": 0}
        self._state = "ok"
        self._connected = True
        self._backoff = 0.0
        self._last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="feature-store-flusher", daemon=True)
        self._thread.start()

    # ---------- caller side ----------
    def put(self, record: TraceRecord) -> bool:
        """Queue a record for storage; True if queued. Never blocks on I/O, never raises."""
        try:
            if not record.capture_consent:
                with self._lock:
                    self._c["opted_out"] += 1
                return False
            nbytes = queued_bytes(record)
            with self._lock:
                refused = ("closed" if self._stop else "flusher_dead" if self._state == "dead" else
                           "queue_full" if (len(self._q) >= self.cfg.queue_max_records
                                            or self._q_bytes + nbytes > self.cfg.queue_max_bytes) else None)
                if refused:
                    self._drops[refused] += 1
                    return False
                self._q.append((record, nbytes))
                self._q_bytes += nbytes
                self._c["accepted"] += 1
                if len(self._q) >= self.cfg.batch_max_records:
                    self._wake.notify()
            return True
        except Exception:  # noqa: BLE001 - the caller's request must never fail because of the store
            try:
                with self._lock:
                    self._drops["bad_record"] += 1
            except Exception:  # noqa: BLE001
                pass
            return False

    def stats(self) -> WriterStats:
        with self._lock:
            state = self._state
            if state != "dead" and not self._stop and not self._thread.is_alive():  # died past its own handler
                state = "dead"
            return WriterStats(queued=len(self._q), queued_bytes=self._q_bytes, state=state,
                               connected=self._connected, backoff_s=self._backoff, last_error=self._last_error,
                               dropped=sum(self._drops.values()), dropped_by_reason=dict(self._drops), **self._c)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait (bounded) until the queue is empty and no batch is in flight; True if it is."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._wake.notify()
            while self._q or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(min(left, 0.05))
            return True

    def close(self, timeout: float = 5.0) -> None:
        """Flush what the store accepts within `timeout`, drop (and count) the rest, stop the flusher."""
        self.flush(timeout)
        with self._lock:
            self._stop = True
            self._stopping.set()
            self._drops["closed"] += len(self._q)
            self._q.clear()
            self._q_bytes = 0
            self._wake.notify()
        self._thread.join(timeout)
        self._publish_counters()
        if self._own_backend:
            self.backend.close()

    # ---------- flusher thread ----------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - a bug: say so in stats() and count what it strands
            log.exception("feature store: the flusher thread died; nothing more will be written")
            with self._lock:
                self._state = "dead"
                self._last_error = _stamped(f"flusher died: {type(e).__name__}: {e}")
                self._drops["flusher_dead"] += len(self._q) + self._in_flight
                self._q.clear()
                self._q_bytes = self._in_flight = 0
                self._idle.notify_all()

    def _loop(self) -> None:
        next_publish = next_maintain = time.monotonic()
        while True:
            with self._lock:
                if self._stop and not self._q:
                    return
                state = self._state
            if state == "down":
                self._reconnect()
                continue
            if state == "erroring" and self._sleep_backoff():
                continue
            batch = self._take(1 if state == "erroring" else self.cfg.batch_max_records)
            if batch:
                self._write(batch)
            now = time.monotonic()
            if now >= next_publish:
                self._publish_counters()
                next_publish = now + COUNTER_PUBLISH_S
            if now >= next_maintain and self._state == "ok":
                self._maintain()
                next_maintain = now + MAINTAIN_S

    def _take(self, limit: int) -> list[tuple[TraceRecord, int]]:
        with self._lock:
            if not self._q and not self._stop:
                self._wake.wait(self.cfg.flush_interval_s)
            batch = [self._q.popleft() for _ in range(min(len(self._q), limit))]
            self._q_bytes -= sum(n for _, n in batch)
            self._in_flight = len(batch)
            return batch

    def _write(self, batch: list[tuple[TraceRecord, int]]) -> None:
        """Encode and append one batch; count every record of it as written or dropped (by reason)."""
        payloads, bad = [], 0
        for record, _ in batch:
            try:
                payloads.append(encode_record(record, self.cfg.codec))
            except Exception:  # noqa: BLE001 - a bad record is dropped and counted, never fatal
                log.exception("feature store: record %s could not be encoded", getattr(record, "request_id", "?"))
                bad += 1
        stored, failure = len(payloads), None
        try:
            if payloads:
                self.backend.append(payloads)
        except StoreRejected as e:  # before StoreUnavailable: its subclass
            stored, failure = min(max(e.stored, 0), len(payloads)), ("rejected", "erroring", e)
        except (StoreUnavailable, OSError) as e:
            stored, failure = 0, ("store_down", "down", e)
        except Exception as e:  # noqa: BLE001 - whatever a backend raises, the flusher goes on
            stored, failure = 0, ("write_error", "erroring", e)
        with self._lock:
            self._c["written"] += stored
            self._drops["encode_error"] += bad
            if failure is not None:
                reason, state, e = failure
                self._drops[reason] += len(payloads) - stored
                self._fail(state, f"{reason}: {type(e).__name__}: {e}", len(payloads) - stored)
            elif payloads and self._state != "ok":
                log.info("feature store: the store takes writes again")
                self._state, self._connected, self._backoff = "ok", True, 0.0
            self._in_flight = 0
            self._idle.notify_all()

    def _fail(self, state: str, error: str, lost: int = 0) -> None:
        """Enter `state` ("down" or "erroring") and double the backoff; the caller holds the lock."""
        if state != self._state or lost:
            log.warning("feature store: %s, %d records dropped: %s", state, lost, error)
        self._state, self._connected = state, state != "down"
        self._backoff = min(self.cfg.backoff_max_s, max(self.cfg.backoff_initial_s, 2 * self._backoff))
        self._last_error = _stamped(error)

    def _sleep_backoff(self) -> bool:
        """Sleep the current backoff, interruptible by close(); True if close() cut it short."""
        with self._lock:
            self._idle.notify_all()
            delay = self._backoff
        return self._stopping.wait(delay)

    def _reconnect(self) -> None:
        """Sleep the current backoff, then ping; double the delay on failure. A store that answers the ping
        but refuses it (NOAUTH) is "erroring": then only a write can tell when it takes writes again."""
        if self._sleep_backoff():
            return
        try:
            self.backend.ping()
        except StoreRejected as e:
            with self._lock:
                self._fail("erroring", f"rejected: {type(e).__name__}: {e}")
            return
        except Exception as e:  # noqa: BLE001
            with self._lock:
                self._fail("down", f"store_down: {type(e).__name__}: {e}")
            return
        with self._lock:
            self._state, self._connected, self._backoff = "ok", True, 0.0
        log.info("feature store: reconnected")

    def _publish_counters(self) -> None:
        with self._lock:
            current = dict(self._c, dropped=sum(self._drops.values()))
            deltas = {k: current[k] - v for k, v in self._published.items()}
        if not any(deltas.values()) or not self._connected:
            return
        try:
            self.backend.add_counters(deltas)
        except Exception:  # noqa: BLE001 - published next time
            return
        with self._lock:
            for k, v in deltas.items():
                self._published[k] += v

    def _maintain(self) -> None:
        try:
            self.backend.maintain()
        except Exception as e:  # noqa: BLE001
            log.warning("feature store: retention pass failed: %s", e)


def queued_bytes(record: TraceRecord) -> int:
    """What a record weighs in the put() queue (before encoding): its ids and hidden states."""
    return 8 * len(record.input_ids) + sum(h.nbytes for h in (record.aux_hidden, record.final_hidden) if h is not None)


def write_records(config: StoreConfig, records: Iterable[TraceRecord], timeout: float = 60.0) -> WriterStats:
    """Store `records` in bulk (seeding a store: tests, benchmarks) and wait until they are written. Unlike a
    server's `put`, which drops what a full queue refuses, this waits for the queue to drain before a record
    that would not fit (long records weigh tens of MB each); a record that is still not stored is an error:
    raises RuntimeError saying how many were lost."""
    writer, n = StoreWriter(config), 0
    try:
        for record in records:
            with writer._lock:
                full = (len(writer._q) >= config.queue_max_records
                        or writer._q_bytes + queued_bytes(record) > config.queue_max_bytes)
            if full:
                writer.flush(timeout)
            writer.put(record)
            n += 1
        writer.flush(timeout)
    finally:
        writer.close()
    stats = writer.stats()
    if stats.written != n:
        raise RuntimeError(f"{n - stats.written} of {n} records were not stored ({stats.dropped} dropped, "
                           f"{stats.opted_out} opted out, {stats.dropped_by_reason['encode_error']} not encodable)")
    return stats
