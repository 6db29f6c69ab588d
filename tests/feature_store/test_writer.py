"""Writer side: opt-out, never blocking or raising when the store is slow, down or refusing, backoff, states,
drops counted by reason, a flusher that survives anything a backend raises and says so if a bug kills it."""

import threading

import pytest

from feature_store.backend import StoreRejected, StoreUnavailable
from feature_store.local import LocalBackend
from feature_store.reader import StoreReader
from feature_store.writer import DROP_REASONS, StoreWriter, write_records
from tests.feature_store.conftest import StubBackend, make_record, wait_until


class SlowBackend(StubBackend):
    """A store that hangs on every write until released, then fails `fail` times."""

    def __init__(self, fail: int = 0):
        self.release = threading.Event()
        self.fail = fail
        self.pings = 0
        self.returned = 0  # appends that came back (released, or gave up waiting)
        self.written: list[bytes] = []

    def append(self, payloads):
        self.release.wait(10)
        self.returned += 1
        if self.fail > 0:
            self.fail -= 1
            raise StoreUnavailable("down")
        self.written += payloads

    def ping(self):
        self.pings += 1
        if self.fail > 0:
            self.fail -= 1
            raise StoreUnavailable("still down")


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
    accepted = sum(w.put(make_record(i)) for i in range(100))
    assert backend.returned == 0  # every put came back while the store's first write was still hung
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


def test_write_records_waits_for_the_queue_instead_of_dropping_long_records(local_cfg):
    """Records heavier than the put() queue holds at once (long sessions: tens of MB of hidden states) are all
    stored by the bulk writer, which waits for the queue to drain; a server's put() would drop them."""
    from feature_store.writer import queued_bytes

    records = [make_record(i) for i in range(12)]
    cfg = local_cfg(queue_max_bytes=3 * queued_bytes(records[0]))
    stats = write_records(cfg, records)
    assert stats.written == 12 and stats.dropped == 0
    assert len(StoreReader(cfg).read(20)) == 12


class RefusingBackend(StubBackend):
    """A store that answers but raises `error` on every write while it is set (None: takes every write)."""

    def __init__(self, error: Exception | None = None):
        self.error = error
        self.written: list[bytes] = []
        self.pings = 0

    def append(self, payloads):
        if self.error is not None:
            raise self.error
        self.written += payloads

    def ping(self):
        self.pings += 1  # answers even while writes are refused, like Redis under OOM or READONLY


def test_a_refused_write_means_erroring_one_probe_per_backoff_and_ok_again_when_it_is_taken(local_cfg):
    backend = RefusingBackend(StoreRejected("redis refused the write: READONLY You can't write against a read "
                                           "only replica."))
    w = StoreWriter(local_cfg(backoff_initial_s=0.01, backoff_max_s=0.05, batch_max_records=4), backend=backend)
    for i in range(4):
        assert w.put(make_record(i))
    assert wait_until(lambda: w.stats().dropped_by_reason["rejected"] == 4, 20)
    s = w.stats()
    assert (s.state, s.connected, s.written, s.dropped) == ("erroring", True, 0, 4) and "READONLY" in s.last_error
    assert w.put(make_record(4)) and w.put(make_record(5))
    assert wait_until(lambda: w.stats().dropped_by_reason["rejected"] >= 5, 20)  # a probe of one record, refused
    assert w.stats().state == "erroring"
    backend.error = None
    assert w.flush(20)
    s = w.stats()
    assert s.state == "ok" and s.backoff_s == 0.0 and "READONLY" in s.last_error
    assert s.written + s.dropped_by_reason["rejected"] == 6 and len(backend.written) == s.written >= 1
    w.close()


def test_anything_a_backend_raises_never_kills_the_flusher(local_cfg):
    import redis

    backend = RefusingBackend(redis.exceptions.OutOfMemoryError("command not allowed when used memory > "
                                                                "'maxmemory'."))  # an unmapped client error
    w = StoreWriter(local_cfg(backoff_initial_s=0.01, backoff_max_s=0.05), backend=backend)
    assert w.put(make_record(0))
    assert wait_until(lambda: w.stats().dropped_by_reason["write_error"] == 1, 20)
    s = w.stats()
    assert s.state == "erroring" and "OutOfMemoryError" in s.last_error and w._thread.is_alive()
    backend.error = ZeroDivisionError("a bug in the backend")
    assert w.put(make_record(1))
    assert wait_until(lambda: w.stats().dropped_by_reason["write_error"] == 2, 20)
    assert "ZeroDivisionError" in w.stats().last_error and w._thread.is_alive()
    backend.error = None
    assert w.put(make_record(2)) and w.flush(20)
    w.close()
    s = w.stats()
    assert (s.state, s.written, s.dropped) == ("ok", 1, 2)


def test_a_batch_cut_half_way_counts_what_was_stored(local_cfg):
    class HalfStored(RefusingBackend):
        """Takes the first half (rounded up) of every batch, then refuses, as a pipeline cut by maxmemory."""

        def append(self, payloads):
            half = (len(payloads) + 1) // 2
            self.written += payloads[:half]
            raise StoreRejected("redis refused the write: OOM command not allowed", stored=half)

    backend = HalfStored()
    w = StoreWriter(local_cfg(batch_max_records=5, backoff_initial_s=0.01, backoff_max_s=0.05), backend=backend)
    for i in range(5):
        assert w.put(make_record(i))
    assert wait_until(lambda: w.stats().written + w.stats().dropped == 5, 20)
    s = w.stats()
    assert s.written == len(backend.written) >= 1 and s.dropped_by_reason["rejected"] == 5 - s.written
    w.close(timeout=0.5)


def test_every_drop_is_counted_under_one_reason(local_cfg, monkeypatch):
    import feature_store.writer as writer_mod

    real = writer_mod.encode_record
    monkeypatch.setattr(writer_mod, "encode_record",
                        lambda r, codec: real(r, codec) if r.request_id != "req-1" else 1 / 0)
    backend = SlowBackend()
    w = StoreWriter(local_cfg(queue_max_records=3, batch_max_records=8), backend=backend)
    accepted = sum(w.put(make_record(i)) for i in range(6))  # 3 queued, at most one batch in flight
    assert accepted <= 4
    assert w.put("not a record") is False  # bad_record
    assert w.put(make_record(9, capture_consent=False)) is False  # opted out: not a drop
    backend.release.set()
    assert w.flush(20)
    w.close()
    assert w.put(make_record(5)) is False  # closed
    s = w.stats()
    assert {k: v for k, v in s.dropped_by_reason.items() if v} == {"queue_full": 6 - accepted, "bad_record": 1,
                                                                    "encode_error": 1, "closed": 1}
    assert s.written == accepted - 1 and s.dropped == 6 - accepted + 3 and s.opted_out == 1
    assert set(s.dropped_by_reason) == set(DROP_REASONS)


def test_a_flusher_killed_by_a_bug_says_dead_and_counts_what_it_strands(local_cfg):
    backend = SlowBackend()
    w = StoreWriter(local_cfg(flush_interval_s=0.01), backend=backend)

    def bug(limit):
        raise KeyError("a bug in the flusher")

    w._take = bug  # the loop's next step raises past every handler around the store
    assert wait_until(lambda: w.stats().state == "dead", 20)
    assert w.put(make_record(0)) is False
    s = w.stats()
    assert "KeyError" in s.last_error and "a bug in the flusher" in s.last_error
    assert s.dropped_by_reason["flusher_dead"] == 1
    backend.release.set()
    w.close(timeout=1)
