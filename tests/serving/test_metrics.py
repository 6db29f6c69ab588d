"""Gateway metrics from replica statuses: the store writer's drops by reason and its state, as Prometheus reads
them. The writer is real; its store is a stand-in that refuses every write, as Redis does under maxmemory."""

from feature_store.backend import StoreRejected
from feature_store.config import StoreConfig
from feature_store.writer import StoreWriter
from serving.messages import ServerStatus
from serving.metrics import GatewayMetrics
from tests.feature_store.conftest import StubBackend, make_record, wait_until


class RefusingStore(StubBackend):
    def append(self, payloads):
        raise StoreRejected("redis refused the write: OOM command not allowed when used memory > 'maxmemory'.")

    def ping(self):
        pass


def status(replica: str, store: dict | None) -> ServerStatus:
    return ServerStatus(replica=replica, head_version="v1", backend="reference", running=0, waiting=0, served=0,
                        refused=0, failed=0, cancelled=0, store=store)


def test_drops_by_reason_and_the_store_state_are_exported_per_replica(tmp_path):
    cfg = StoreConfig(backend="local", local_root=str(tmp_path / "store"), flush_interval_s=0.01,
                      backoff_initial_s=0.01, backoff_max_s=0.05)
    writer = StoreWriter(cfg, backend=RefusingStore())
    try:
        assert writer.put(make_record(0))
        assert wait_until(lambda: writer.stats().state == "erroring", 20)
        m = GatewayMetrics()
        m.refresh([status("r0", vars(writer.stats())), status("r1", None)], 0, 0, 0.0)  # as DecodeServer.status
        text = m.render().decode()
        assert 'ae_capture_store_state{replica="r0",state="erroring"} 1.0' in text
        assert 'ae_capture_dropped_by_reason{reason="rejected",replica="r0"} 1.0' in text
        assert 'ae_capture_dropped_by_reason{reason="queue_full",replica="r0"} 0.0' in text
        assert 'ae_capture_dropped{replica="r0"} 1.0' in text
        assert 'ae_capture_store_state{replica="r1"' not in text  # no writer, no state
        m.refresh([status("r0", dict(vars(writer.stats()), state="ok"))], 0, 0, 0.0)  # one state at a time
        text = m.render().decode()
        assert 'state="ok"} 1.0' in text and 'state="erroring"' not in text
    finally:
        writer.close(timeout=0.5)


def test_a_replica_answering_from_a_new_process_counts_a_restart():
    m = GatewayMetrics()

    def scrape(pid):
        st = ServerStatus(replica="r0", head_version="v1", backend="reference", running=0, waiting=0, served=0,
                          refused=0, failed=0, cancelled=0, pid=pid)
        m.refresh([st] if pid else [], 0, 0, 0.0, replicas_up={"r0": pid is not None})
        return m.render().decode()

    assert 'ae_replica_restarts_total{replica="r0"} 0.0' in scrape(100)
    assert 'ae_replica_restarts_total{replica="r0"} 0.0' in scrape(None)  # down: no status, nothing counted yet
    assert 'ae_replica_restarts_total{replica="r0"} 1.0' in scrape(101)  # Ray restarted it: a new pid
    assert 'ae_replica_restarts_total{replica="r0"} 1.0' in scrape(101)
