"""Writer side: opt-out, never blocking or raising when the store is slow or down, backoff, counters."""

import threading
import time

import pytest

from feature_store.backend import StoreUnavailable
from feature_store.local import LocalBackend
from feature_store.reader import StoreReader
from feature_store.writer import StoreWriter, write_records
from tests.feature_store.conftest import make_record, wait_until


class SlowBackend:
    """A store that hangs on every write until released, then fails `fail` times."""

    def __init__(self, fail: int = 0):
        self.release = threading.Event()
        self.fail = fail
        self.pings = 0
        self.written: list[bytes] = []

    def append(self, payloads):
        self.release.wait(10)
        if self.fail > 0:
            self.fail -= 1
            raise StoreUnavailable("down")
        self.written += payloads

    def ping(self):
        self.pings += 1
        if self.fail > 0:
            self.fail -= 1
            raise StoreUnavailable("still down")

    def add_counters(self, deltas):
        pass

    def maintain(self):
        pass

    def close(self):
        pass


def test_opted_out_requests_are_never_stored(local_cfg):
    cfg = local_cfg()
    w = StoreWriter(cfg)
    assert not w.put(make_record(0, capture_consent=False))
    assert w.put(make_record(1))
    w.close()
    r = StoreReader(cfg)
    assert [d.record.request_id for d in r.read(10)] == ["req-1"]
    s = r.stats()
    assert (s.opted_out, s.written, s.dropped) == (1, 1, 0)


def test_put_never_blocks_on_a_hung_store_and_drops_when_full(local_cfg):
    backend = SlowBackend()
    w = StoreWriter(local_cfg(queue_max_records=8, batch_max_records=4), backend=backend)
    t0 = time.monotonic()
    accepted = sum(w.put(make_record(i)) for i in range(100))
    assert time.monotonic() - t0 < 2.0
    assert accepted <= 8 + 4  # queue + one batch in flight
    assert w.stats().dropped == 100 - accepted
    backend.release.set()
    assert w.flush(10)
    w.close()
    assert len(backend.written) == accepted


def test_queue_is_bounded_in_bytes(local_cfg):
    backend = SlowBackend()
    rec = make_record(0, tokens=64, hidden=64)
    w = StoreWriter(local_cfg(queue_max_bytes=3 * rec.aux_hidden.nbytes), backend=backend)
    assert sum(w.put(rec) for _ in range(20)) <= 4
    backend.release.set()
    w.close()


def test_failed_writes_are_dropped_counted_then_the_writer_reconnects_with_backoff(local_cfg):
    backend = SlowBackend(fail=3)
    backend.release.set()
    w = StoreWriter(local_cfg(backoff_initial_s=0.01, backoff_max_s=0.05, batch_max_records=2), backend=backend)
    w.put(make_record(0))
    w.put(make_record(1))
    assert wait_until(lambda: w.stats().dropped == 2)
    assert wait_until(lambda: w.stats().connected, 5)
    assert backend.pings >= 3  # two failed pings, then success
    assert w.put(make_record(2))
    assert w.flush(5)
    w.close()
    assert w.stats().written == 1 and w.stats().backoff_s == 0.0


def test_bad_records_never_raise_into_the_caller(local_cfg):
    w = StoreWriter(local_cfg())
    assert w.put(object()) is False  # not a TraceRecord
    w.close()
    assert w.stats().dropped == 1


def test_writer_with_local_backend_end_to_end(local_cfg):
    cfg = local_cfg()
    w = StoreWriter(cfg, backend=LocalBackend(cfg))
    for i in range(30):
        w.put(make_record(i))
    w.close()
    assert w.stats().written == 30


def test_write_records_stores_every_record_or_says_how_many_were_lost(local_cfg):
    cfg = local_cfg()
    assert write_records(cfg, [make_record(i) for i in range(5)]).written == 5
    assert sorted(d.record.request_id for d in StoreReader(cfg).read(10)) == [f"req-{i}" for i in range(5)]
    with pytest.raises(RuntimeError, match=r"1 of 2 records were not stored \(0 dropped, 1 opted out"):
        write_records(cfg, [make_record(5), make_record(6, capture_consent=False)])
