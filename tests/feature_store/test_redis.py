"""Redis-streams backend against a real redis-server: round trip, pending re-delivery after a consumer
dies, SIGKILL of Redis during writes, corrupt payloads, caps, spill pointers, AUTH."""

import os
import signal
import subprocess
import sys
import time

import pytest
import redis

from feature_store.backend import StoreRejected
from feature_store.config import StoreConfig
from feature_store.reader import StoreReader
from feature_store.redis_backend import RedisBackend
from feature_store.schema import encode_record
from feature_store.writer import StoreWriter
from tests.feature_store.conftest import free_port, make_record, spawn_redis, wait_until

pytestmark = pytest.mark.redis


def ids_of(deliveries):
    return [d.record.request_id for d in deliveries]


def test_write_read_ack_round_trip(redis_cfg):
    cfg = redis_cfg()
    w = StoreWriter(cfg)
    for i in range(5):
        assert w.put(make_record(i))
    assert w.flush(10)
    r = StoreReader(cfg, group="trainer", consumer="a")
    got = r.read(10, block_ms=200)
    assert ids_of(got) == [f"req-{i}" for i in range(5)]
    assert got[0].record.aux_hidden.shape == (12, 24)
    s = r.stats()
    assert (s.records, s.pending, s.lag) == (5, 5, 5)
    r.ack(got)
    w.close()
    s = r.stats()
    assert (s.pending, s.lag, s.written, s.dropped) == (0, 0, 5, 0)
    assert r.read(10) == []
    keys = redis.Redis.from_url(cfg.redis_url).keys(f"{cfg.key_prefix}:*")
    assert keys and all(k.decode().startswith(cfg.key_prefix + ":") for k in keys)


def test_consumer_killed_mid_batch_its_pending_records_go_to_another(redis_cfg):
    cfg = redis_cfg(claim_idle_ms=300)
    b = RedisBackend(cfg)
    b.append([encode_record(make_record(i), "int8") for i in range(6)])
    b._ensure_group("trainer")
    code = ("import redis,sys,time; r=redis.Redis.from_url(sys.argv[1]); "
            "r.xreadgroup('trainer','dying',{sys.argv[2]:'>'},count=4); print('read',flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code, cfg.redis_url, cfg.key], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "read"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    other = StoreReader(cfg, group="trainer", consumer="survivor", backend=b)
    first = other.read(10)
    assert ids_of(first) == ["req-4", "req-5"]  # the dead consumer's 4 are pending, not yet idle
    other.ack(first)
    time.sleep(0.35)
    again = other.read(10)
    assert sorted(ids_of(again)) == [f"req-{i}" for i in range(4)]
    other.ack(again)
    assert other.stats().lag == 0


def test_redis_sigkilled_during_writes_the_writer_never_raises_and_resumes(tmp_path):
    port = free_port()
    proc = spawn_redis(port, tmp_path / "r1")
    cfg = StoreConfig(backend="redis", redis_url=f"redis://127.0.0.1:{port}/0", key_prefix="kill",
                      queue_max_records=32, batch_max_records=8, flush_interval_s=0.005, socket_timeout_s=0.5,
                      backoff_initial_s=0.02, backoff_max_s=0.2)
    w = StoreWriter(cfg)
    try:
        for i in range(50):
            w.put(make_record(i))
        assert w.flush(10)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        for i in range(50, 450):  # the caller keeps going while Redis is gone: a put that waited for Redis
            w.put(make_record(i))  # would have dropped nothing (checked below), one that never returned would hang
        assert wait_until(lambda: not w.stats().connected, 10)
        assert w.stats().dropped > 0
        proc = spawn_redis(port, tmp_path / "r2")
        assert wait_until(lambda: w.stats().connected, 15)
        client = redis.Redis.from_url(cfg.redis_url)
        for i in range(1000, 1010):
            w.put(make_record(i))
        assert w.flush(10)
        ids = [f[b"p"] for _, f in client.xrange(cfg.key)]
        assert len(ids) >= 10  # writes resumed (plus whatever sat in the queue)
        w.close()
        s = w.stats()
        assert s.written + s.dropped == 460 and s.queued == 0  # every put is accounted for
        assert client.hget(cfg.stats_key, "dropped") is not None  # counters published after recovery
    finally:
        proc.kill()
        proc.wait(10)


def test_corrupt_payloads_are_skipped_and_counted(redis_cfg):
    cfg = redis_cfg()
    b = RedisBackend(cfg)
    good = encode_record(make_record(1), "int8")
    b.append([good, b"not arrow", good[:-50], good])
    b.r.xadd(cfg.key, {"ptr": "missing/file.arrows", "n": 10, "crc": 1})  # a lost spill file
    r = StoreReader(cfg, backend=b)
    got = r.read(10)
    assert ids_of(got) == ["req-1", "req-1"]
    r.ack(got)
    s = r.stats()
    assert s.corrupt == 3 and s.lag == 0 and s.pending == 0  # corrupt entries are acked, not stuck


def test_caps_hold_by_length_and_bytes_and_ttl(redis_cfg):
    payload = encode_record(make_record(0, hidden=None), "int8")
    cfg = redis_cfg(max_stream_len=50)
    b = RedisBackend(cfg)
    for _ in range(10):
        b.append([payload] * 50)
    assert b.r.xlen(cfg.key) <= 50 + 100  # MAXLEN ~ trims whole stream nodes (100 entries)
    cfg2 = redis_cfg(max_stream_bytes=40 * len(payload), trim_approximate=False)
    b2 = RedisBackend(cfg2)
    for _ in range(10):
        b2.append([payload] * 20)
    assert b2.stream_payload_bytes() <= 40 * (len(payload) + 8)
    b2.maintain(now=time.time() + cfg2.retention_s + 10)  # TTL: everything is older than retention
    assert b2.r.xlen(cfg2.key) == 0


def test_large_payloads_spill_to_files_with_only_a_pointer_in_redis(redis_cfg):
    cfg = redis_cfg(spill_threshold_bytes=20000, spill_max_bytes=10**9)
    w = StoreWriter(cfg)
    w.put(make_record(0, tokens=128, hidden=128))  # large
    w.put(make_record(1, hidden=None))  # small
    assert w.flush(10)
    w.close()
    raw = redis.Redis.from_url(cfg.redis_url).xrange(cfg.key)
    assert set(raw[0][1]) == {b"ptr", b"n", b"crc"} and set(raw[1][1]) == {b"p"}
    r = StoreReader(cfg)
    got = r.read(10)
    assert ids_of(got) == ["req-0", "req-1"] and got[0].record.aux_hidden.shape == (128, 384)
    spilled = list((tmp := os.path.join(cfg.spill_dir, cfg.key_prefix, cfg.stream)) and os.listdir(tmp))
    assert len(spilled) == 1
    RedisBackend(cfg.model_copy(update={"spill_max_bytes": 1})).maintain()
    assert os.listdir(tmp) == []


def test_auth_password_from_config(tmp_path):
    port = free_port()
    proc = spawn_redis(port, tmp_path / "auth", "--requirepass", "s3cret")
    try:
        url = f"redis://127.0.0.1:{port}/0"
        bad = RedisBackend(StoreConfig(backend="redis", redis_url=url, socket_timeout_s=0.5))
        with pytest.raises(StoreRejected, match="NOAUTH"):  # answered and refused: the writer drops and backs off
            bad.append([b"x"])
        ok = RedisBackend(StoreConfig(backend="redis", redis_url=url, redis_password="s3cret"))
        ok.append([encode_record(make_record(0), "int8")])
        assert ok.stats().records == 1
        assert "s3cret" not in repr(ok.cfg)
    finally:
        proc.kill()
        proc.wait(10)
