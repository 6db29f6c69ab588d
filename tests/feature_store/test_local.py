"""Local Arrow-segment backend: round trip, torn tails, offsets across restarts, rotation, retention, one writer."""

import os
import time

import pytest

from feature_store.backend import StoreRejected
from feature_store.local import LocalBackend
from feature_store.reader import StoreReader
from feature_store.schema import encode_record
from tests.feature_store.conftest import make_record


def payloads(n, start=0, codec="int8"):
    return [encode_record(make_record(i), codec) for i in range(start, start + n)]


def ids_of(deliveries):
    return [d.record.request_id for d in deliveries]


def test_write_read_ack_round_trip(local_cfg):
    cfg = local_cfg()
    b = LocalBackend(cfg)
    b.append(payloads(5))
    r = StoreReader(cfg, backend=b)
    got = r.read(10)
    assert ids_of(got) == [f"req-{i}" for i in range(5)]
    assert r.stats().pending == 5 and r.stats().lag == 5
    r.ack(got[:3])
    assert r.stats().lag == 2
    r.ack(got[3:])
    s = r.stats()
    assert (s.lag, s.pending, s.records) == (0, 0, 5)
    assert r.read(10) == []


def test_unacked_records_are_redelivered_after_restart_and_offsets_survive(local_cfg):
    cfg = local_cfg()
    b = LocalBackend(cfg)
    b.append(payloads(6))
    r = StoreReader(cfg, backend=b)
    got = r.read(4)
    r.ack(got[:2])  # req-2, req-3 delivered but never acked: the consumer "dies"
    b.close()
    r2 = StoreReader(cfg, backend=LocalBackend(cfg))
    assert ids_of(r2.read(10)) == ["req-2", "req-3", "req-4", "req-5"]


def test_idle_pending_records_are_redelivered(local_cfg):
    cfg = local_cfg(claim_idle_ms=50)
    b = LocalBackend(cfg)
    b.append(payloads(2))
    r = StoreReader(cfg, backend=b)
    assert len(r.read(10)) == 2
    time.sleep(0.08)
    assert ids_of(r.read(10)) == ["req-0", "req-1"]


def test_torn_tail_is_skipped_never_returned_and_recovered_by_the_writer(local_cfg):
    cfg = local_cfg()
    b = LocalBackend(cfg)
    b.append(payloads(3))
    b.close()
    seg = sorted((os.path.join(cfg.local_root, "segments", f)
                  for f in os.listdir(os.path.join(cfg.local_root, "segments"))))[-1]
    with open(seg, "r+b") as f:
        f.truncate(os.path.getsize(seg) - 30)  # the last record is torn
    reader = StoreReader(cfg, backend=LocalBackend(cfg))
    assert ids_of(reader.read(10)) == ["req-0", "req-1"]
    w = LocalBackend(cfg)
    w.append(payloads(2, start=10))  # the writer truncates the torn tail, then appends
    assert ids_of(reader.read(10)) == ["req-10", "req-11"]
    assert w.counters()["corrupt"] == 1


def test_crc_mismatch_is_skipped_and_counted(local_cfg):
    cfg = local_cfg()
    b = LocalBackend(cfg)
    b.append(payloads(3))
    seg = os.path.join(cfg.local_root, "segments", os.listdir(os.path.join(cfg.local_root, "segments"))[0])
    first = b.read("g", count=1)[0]
    off = int(first.id.split("-")[1]) + 8 + len(first.payload) + 8 + 50  # inside the second payload
    with open(seg, "r+b") as f:
        f.seek(off)
        byte = f.read(1)
        f.seek(off)
        f.write(bytes([byte[0] ^ 0xFF]))
    r = StoreReader(cfg, group="other", backend=b)
    assert ids_of(r.read(10)) == ["req-0", "req-2"]
    assert r.stats().corrupt == 1


def test_rotation_and_retention_by_bytes_and_age(local_cfg):
    one = len(payloads(1)[0])
    cfg = local_cfg(segment_bytes=3 * one, local_max_bytes=12 * one + 4096, retention_s=3600)
    b = LocalBackend(cfg)
    for i in range(40):
        b.append(payloads(1, start=i))
    segs = sorted(os.listdir(os.path.join(cfg.local_root, "segments")))
    assert len(segs) == 14  # rotated: 3 records per segment
    b.maintain()
    st = b.stats()
    assert st.bytes <= cfg.local_max_bytes + one
    remaining = sorted(os.listdir(os.path.join(cfg.local_root, "segments")))
    assert remaining[-1] == segs[-1]  # newest segments kept
    # age: everything but the active segment is older than the retention window
    b.maintain(now=time.time() + 7200)
    assert sorted(os.listdir(os.path.join(cfg.local_root, "segments"))) == [segs[-1]]
    # a reader whose offset points into a deleted segment continues with what is left
    r = StoreReader(cfg, backend=b)
    got = r.read(100)
    assert got and ids_of(got)[-1] == "req-39"


def test_one_writer_process_at_a_time(local_cfg):
    cfg = local_cfg()
    a = LocalBackend(cfg)
    a.append(payloads(1))
    assert a._writer_lock_fd is not None
    a.close()
    b = LocalBackend(cfg)
    b.append(payloads(1))  # the lock was released
    assert b.stats().records == 2


def test_a_second_writer_is_refused_not_down(local_cfg):
    cfg = local_cfg()
    a = LocalBackend(cfg)
    a.append(payloads(1))
    b = LocalBackend(cfg)
    b.ping()  # the store is there: a ping cannot tell, only the write is refused
    with pytest.raises(StoreRejected, match="another process writes"):
        b.append(payloads(1))
    a.close()
    b.close()


def test_tail_returns_the_newest(local_cfg):
    cfg = local_cfg(segment_bytes=4096)
    b = LocalBackend(cfg)
    for i in range(10):
        b.append(payloads(1, start=i))
    from feature_store.schema import decode_record

    assert [decode_record(e.payload).request_id for e in b.tail(3)] == ["req-7", "req-8", "req-9"]
    with pytest.raises(Exception):
        LocalBackend(local_cfg()).append([object()])  # not bytes
