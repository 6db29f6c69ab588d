"""Redis answers but refuses writes (OOM under maxmemory, READONLY replica, NOPERM from an ACL, NOAUTH), on a
real redis-server: the backend raises StoreRejected with Redis's reason, the writer's flusher survives in state
"erroring", every record it could not store is counted by reason, and writing resumes by itself once the
refusal is lifted. A PING succeeds under OOM and READONLY, so each test also shows it is no proof of writes."""

import uuid

import pytest
import redis

from feature_store.backend import StoreRejected
from feature_store.config import StoreConfig
from feature_store.redis_backend import RedisBackend
from feature_store.schema import encode_record
from feature_store.writer import DROP_REASONS, StoreWriter
from tests.feature_store.conftest import free_port, make_record, spawn_redis, wait_until

pytestmark = pytest.mark.redis
DEADLINE_S = 20.0  # generous: the verdict never depends on how fast this machine is


def writer_cfg(url: str, **kw) -> StoreConfig:
    base = dict(backend="redis", redis_url=url, key_prefix=f"t{uuid.uuid4().hex[:10]}", flush_interval_s=0.01,
                backoff_initial_s=0.02, backoff_max_s=0.2, socket_timeout_s=1.0, queue_max_records=8,
                batch_max_records=4)
    base.update(kw)
    return StoreConfig(**base)


def refuse_then_resume(w: StoreWriter, refuse, lift, reason_text: str, store: redis.Redis) -> None:
    """Write 3 records, refuse, put 20 more, lift the refusal, put 5 more: check state, counts and the stream."""
    for i in range(3):
        assert w.put(make_record(i))
    assert w.flush(DEADLINE_S) and w.stats().state == "ok"
    refuse()
    queued = sum(w.put(make_record(i)) for i in range(3, 23))
    assert wait_until(lambda: w.stats().state == "erroring" and w.stats().dropped_by_reason["rejected"] > 0,
                      DEADLINE_S)
    s = w.stats()
    assert reason_text in s.last_error and s.last_error[:4].isdigit()  # "<UTC time> rejected: ..."
    assert s.connected and s.backoff_s > 0 and w._thread.is_alive()
    assert s.dropped_by_reason["queue_full"] == 20 - queued  # put()'s refusals are counted too
    lift()
    queued += sum(w.put(make_record(i)) for i in range(23, 28))
    assert wait_until(lambda: w.stats().state == "ok", DEADLINE_S)  # resumed by itself
    assert w.flush(DEADLINE_S)
    w.close()
    s = w.stats()
    assert s.written + s.dropped == 28 and s.queued == 0  # every put is accounted for
    assert s.dropped == sum(s.dropped_by_reason.values()) and set(s.dropped_by_reason) == set(DROP_REASONS)
    assert all(s.dropped_by_reason[r] == 0 for r in ("bad_record", "encode_error", "write_error", "flusher_dead"))
    assert store.xlen(w.cfg.key) == s.written >= 3 + 1  # the first records, then at least one after the lift
    assert s.state == "ok" and reason_text in s.last_error  # the last failure is kept after recovery


@pytest.fixture
def admin(redis_url):
    """A client on the shared server that puts back every CONFIG value a test changed."""
    client = redis.Redis.from_url(redis_url)
    saved = {k: client.config_get(k)[k] for k in ("maxmemory", "maxmemory-policy")}
    yield client
    for k, v in saved.items():
        client.config_set(k, v)
    client.close()


def test_oom_under_maxmemory_the_writer_errors_counts_its_losses_and_resumes(admin, redis_url):
    cfg = writer_cfg(redis_url)
    w = StoreWriter(cfg)

    def refuse():
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)
        backend = RedisBackend(cfg)
        with pytest.raises(StoreRejected, match="OOM command not allowed when used memory > 'maxmemory'") as e:
            backend.append([encode_record(make_record(99), "int8")] * 3)
        assert e.value.stored == 0
        backend.ping()  # PING still answers: no proof that writes work
        backend.close()

    refuse_then_resume(w, refuse, lambda: admin.config_set("maxmemory", 0), "OOM", admin)


def test_readonly_replica_after_a_failover_the_writer_errors_and_resumes_when_promoted(tmp_path):
    port = free_port()
    proc = spawn_redis(port, tmp_path / "replica")
    try:
        store = redis.Redis(port=port)
        w = StoreWriter(writer_cfg(f"redis://127.0.0.1:{port}/0"))

        def refuse():  # demoted to a replica of a primary that is not there (yet): writes get READONLY
            store.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))
            assert wait_until(lambda: store.info("replication")["role"] == "slave", DEADLINE_S)
            store.ping()

        refuse_then_resume(w, refuse, lambda: store.execute_command("REPLICAOF", "NO", "ONE"), "READONLY", store)
    finally:
        proc.kill()
        proc.wait(10)


def test_acl_user_without_write_permission_the_writer_errors_and_resumes_when_granted(redis_url):
    admin, user = redis.Redis.from_url(redis_url), f"u{uuid.uuid4().hex[:8]}"
    admin.acl_setuser(user, enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all"])
    try:
        w = StoreWriter(writer_cfg(redis_url, redis_username=user, redis_password="pw"))
        refuse_then_resume(w, lambda: admin.acl_setuser(user, enabled=True, commands=["-xadd"]),
                           lambda: admin.acl_setuser(user, enabled=True, commands=["+xadd"]), "NOPERM", admin)
    finally:
        admin.acl_deluser(user)
        admin.close()


def test_noauth_when_a_password_is_required_the_writer_errors_and_resumes_when_it_is_lifted(tmp_path):
    port = free_port()
    proc = spawn_redis(port, tmp_path / "auth")
    try:
        store = redis.Redis(port=port)
        w = StoreWriter(writer_cfg(f"redis://127.0.0.1:{port}/0"))

        def refuse():
            store.config_set("requirepass", "s3cret")  # this connection stays authenticated
            store.client_kill_filter(skipme=True)  # the writer reconnects and must now authenticate

        def lift():
            store.config_set("requirepass", "")

        refuse_then_resume(w, refuse, lift, "NOAUTH", store)
    finally:
        proc.kill()
        proc.wait(10)
