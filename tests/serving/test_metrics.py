"""Gateway metrics from replica statuses: the store writer's drops by reason and its state, as Prometheus reads
them. The writer is real; its store is a stand-in that refuses every write, as Redis does under maxmemory.
Acceptance by context length: each verify step in the bucket of its first draft's position, six labels at most."""

from feature_store.backend import StoreRejected
from feature_store.config import StoreConfig
from feature_store.writer import StoreWriter
from adaptive_eagle.trace import TraceRecord, VerifyStep
from serving.messages import ServerStatus, SpecMetrics
from serving.metrics import CONTEXT_LABELS, GatewayMetrics, context_fields
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


# ---- acceptance by context length -----------------------------------------------------------------------
def trace(prompt: int, accepted: list[int], version: str = "v1") -> TraceRecord:
    generated = 1 + sum(a + 1 for a in accepted)  # the prefill's token, then accepted + bonus per step
    return TraceRecord(request_id="r", target_fingerprint="t", head_version=version, backend="reference",
                       input_ids=tuple(range(prompt + generated)), loss_mask=(0,) * prompt + (1,) * generated,
                       steps=tuple(VerifyStep(4, a, a) for a in accepted))


def test_each_verify_step_counts_in_the_bucket_where_its_first_draft_lands():
    """A prompt of 508, steps accepting 2, 2, 3: they draft positions 509, 512 and 515, one in 0-512 and two in
    512-1k; the request's context position is the middle of its 11 generated tokens."""
    fields = context_fields(trace(508, [2, 2, 3]))
    assert fields == {"context_position": 508 + 11 // 2, "by_context": (("0-512", 1, 2), ("512-1k", 2, 5))}
    assert context_fields(trace(9000, [1]))["by_context"] == (("8k+", 1, 1),)


def test_context_counters_have_bounded_labels_and_a_bucket_accept_length():
    m = GatewayMetrics()
    spec = SpecMetrics(head_version="v1", accept_length=2.0, verify_steps=3, draft_tokens=12, accepted_drafts=7,
                       **context_fields(trace(508, [2, 2, 3])))
    for _ in range(2):
        m.observe(spec, 10)
    m.observe(SpecMetrics(head_version="v1", accept_length=1.0, verify_steps=1, draft_tokens=4, accepted_drafts=0,
                          by_context=(("4-8k", 1, 0), ("16k+", 5, 5))), 1)  # an unknown label: never a series
    text = m.render().decode()
    assert 'ae_verify_steps_total{context="0-512",head_version="v1"} 2.0' in text
    assert 'ae_verify_steps_total{context="512-1k",head_version="v1"} 4.0' in text
    assert 'ae_accepted_drafts_total{context="512-1k",head_version="v1"} 10.0' in text  # accept length 1 + 10/4
    assert 'ae_verify_steps_total{context="8k+",head_version="v1"} 0.0' in text  # every bucket from the start
    assert "16k+" not in text and "ae_context_labels_refused_total 1.0" in text
    labels = {line.split('context="')[1].split('"')[0] for line in text.splitlines()
              if line.startswith("ae_verify_steps_total{")}
    assert labels == set(CONTEXT_LABELS) == {"0-512", "512-1k", "1-2k", "2-4k", "4-8k", "8k+"}


def test_a_response_carries_its_context_slice():
    spec = SpecMetrics(head_version="v1", accept_length=2.0, verify_steps=1, draft_tokens=4, accepted_drafts=1,
                       **context_fields(trace(2000, [1])))
    assert spec.to_json()["by_context"] == (("1-2k", 1, 1),) and spec.to_json()["context_position"] == 2001
    assert SpecMetrics(head_version="v1", accept_length=1.0, verify_steps=0, draft_tokens=0,
                       accepted_drafts=0).context_position is None
