"""Writer side: a non-blocking `put()` for servers, a bounded queue and a background flusher.

Owns: the queue, the flusher thread, drop/opt-out accounting, reconnection backoff. Must not touch:
the caller's request: `put()` never blocks on I/O and never raises; when the store is slow or down,
records are dropped and counted (`dropped`), requests that opted out are counted (`opted_out`) and
never stored. Records are encoded (codec + Arrow IPC) on the flusher thread, not the caller's.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterable

from adaptive_eagle.trace import TraceRecord
from feature_store.backend import Backend, StoreUnavailable, open_backend
from feature_store.config import StoreConfig
from feature_store.schema import encode_record

log = logging.getLogger(__name__)
COUNTER_PUBLISH_S = 1.0
MAINTAIN_S = 30.0


@dataclass(frozen=True)
class WriterStats:
    accepted: int  # put() calls that queued a record
    written: int  # records the backend acknowledged
    dropped: int  # queue full, store down or a failed write
    opted_out: int  # capture_consent False: never stored
    encode_errors: int  # records that could not be encoded (also counted in dropped)
    queued: int
    queued_bytes: int
    connected: bool
    backoff_s: float  # current reconnect delay (0 when connected)


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
        self._stopping = threading.Event()  # wakes a reconnect backoff sleep on close()
        self._c = {"accepted": 0, "written": 0, "dropped": 0, "opted_out": 0, "encode_errors": 0}
        self._published = {"dropped": 0, "opted_out": 0, "written": 0}
        self._connected = True
        self._backoff = 0.0
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
            nbytes = 8 * len(record.input_ids) + (record.aux_hidden.nbytes if record.aux_hidden is not None else 0)
            with self._lock:
                if (self._stop or len(self._q) >= self.cfg.queue_max_records
                        or self._q_bytes + nbytes > self.cfg.queue_max_bytes):
                    self._c["dropped"] += 1
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
                    self._c["dropped"] += 1
            except Exception:  # noqa: BLE001
                pass
            return False

    def stats(self) -> WriterStats:
        with self._lock:
            return WriterStats(queued=len(self._q), queued_bytes=self._q_bytes, connected=self._connected,
                               backoff_s=self._backoff, **self._c)

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
            self._c["dropped"] += len(self._q)
            self._q.clear()
            self._q_bytes = 0
            self._wake.notify()
        self._thread.join(timeout)
        self._publish_counters()
        if self._own_backend:
            self.backend.close()

    # ---------- flusher thread ----------
    def _take(self) -> list[tuple[TraceRecord, int]]:
        with self._lock:
            if not self._q and not self._stop:
                self._wake.wait(self.cfg.flush_interval_s)
            if not self._connected:
                return []
            batch = [self._q.popleft() for _ in range(min(len(self._q), self.cfg.batch_max_records))]
            self._q_bytes -= sum(n for _, n in batch)
            self._in_flight = len(batch)
            return batch

    def _run(self) -> None:
        next_publish = next_maintain = time.monotonic()
        while True:
            with self._lock:
                if self._stop and not self._q:
                    return
            if not self._connected:
                self._reconnect()
                continue
            batch = self._take()
            if batch:
                self._write(batch)
            now = time.monotonic()
            if now >= next_publish:
                self._publish_counters()
                next_publish = now + COUNTER_PUBLISH_S
            if now >= next_maintain and self._connected:
                self._maintain()
                next_maintain = now + MAINTAIN_S

    def _write(self, batch: list[tuple[TraceRecord, int]]) -> None:
        payloads, bad = [], 0
        for record, _ in batch:
            try:
                payloads.append(encode_record(record, self.cfg.codec))
            except Exception:  # noqa: BLE001 - a bad record is dropped and counted, never fatal
                log.exception("feature store: record %s could not be encoded", getattr(record, "request_id", "?"))
                bad += 1
        try:
            if payloads:
                self.backend.append(payloads)
            ok = len(payloads)
        except (StoreUnavailable, OSError) as e:
            log.warning("feature store: write failed, dropping %d records: %s", len(payloads), e)
            ok = 0
            self._set_down()
        with self._lock:
            self._c["written"] += ok
            self._c["dropped"] += len(batch) - ok
            self._c["encode_errors"] += bad
            self._in_flight = 0
            self._idle.notify_all()

    def _set_down(self) -> None:
        with self._lock:
            self._connected = False
            self._backoff = min(self.cfg.backoff_max_s, max(self.cfg.backoff_initial_s, 2 * self._backoff))

    def _reconnect(self) -> None:
        """Sleep the current backoff (interruptible by close), then ping; double the delay on failure."""
        with self._lock:
            self._idle.notify_all()
            delay = self._backoff
        if self._stopping.wait(delay):
            return
        try:
            self.backend.ping()
        except Exception:  # noqa: BLE001
            self._set_down()
            return
        with self._lock:
            self._connected, self._backoff = True, 0.0
        log.info("feature store: reconnected")

    def _publish_counters(self) -> None:
        with self._lock:
            deltas = {k: self._c[k] - v for k, v in self._published.items()}
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


def write_records(config: StoreConfig, records: Iterable[TraceRecord], timeout: float = 60.0) -> WriterStats:
    """Store `records` in bulk (seeding a store: tests, benchmarks) and wait until they are written. Unlike a
    server's `put`, a record that is not stored is an error: raises RuntimeError saying how many were lost."""
    writer, n = StoreWriter(config), 0
    try:
        for record in records:
            writer.put(record)
            n += 1
        writer.flush(timeout)
    finally:
        writer.close()
    stats = writer.stats()
    if stats.written != n:
        raise RuntimeError(f"{n - stats.written} of {n} records were not stored ({stats.dropped} dropped, "
                           f"{stats.opted_out} opted out, {stats.encode_errors} not encodable)")
    return stats
