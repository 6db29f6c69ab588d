"""Gateway metrics from replica statuses: the store writer's drops by reason and its state, as Prometheus reads
them. The writer is real; its store is a stand-in that refuses every write, as Redis does under maxmemory.
Acceptance by context length: each verify step in the bucket of its first draft's position, six labels at most."""

import torch

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


# ---- the backend's own counts: swaps by how, lost requests, down ---------------------------------------------
def sglang_replica(registry, launch=True):
    """(stand-in host, backend, replica server) on v1 through the protocol-faithful stand-in, as serving.replicas
    builds an SGLang replica: its status carries SGLangBackend.info() as the gateway collects it."""
    from serving.server import DecodeServer
    from serving.sglang_backend import SGLangBackend, SGLangConfig, launch_sglang
    from tests.serving.sglang_standin import StandInHost, WordTokenizer

    host = StandInHost()
    config = SGLangConfig(model_path="/models/tiny", draft_model_path=str(registry.get("v1")), weight_version="v1",
                          launch=launch, health_poll_s=0.001, startup_timeout_s=5.0)
    client = host.client()
    process = launch_sglang(config, client=client, spawn=host.spawn)
    backend = SGLangBackend(config, WordTokenizer(), registry, "v1", "fp", client=client,
                            process=process if launch else None, spawn=host.spawn)
    return host, backend, DecodeServer(backend, name="sg-0")


def sample(text: str, name: str, **labels) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_swaps_by_how_and_a_backend_down_are_exported_from_the_replica_status(tmp_path, caplog):
    """An in-place swap, a swap to a head with another vocabulary (SGLang restarted: a cold start) and a refused
    one, counted by how; then an update that changed the target of a server not launched here takes the backend
    out of service: ae_backend_down 1, its reason in the status (not a label) and in the gateway's log."""
    from tests.serving.sglang_standin import make_registry

    registry = make_registry(tmp_path / "registry")
    host, backend, server = sglang_replica(registry)
    m = GatewayMetrics()
    m.refresh([server.status()], 0, 0, 0.0)
    text = m.render().decode()
    for how in ("session", "restart", "refused"):  # a series at 0 from the first status on
        assert sample(text, "ae_backend_swaps_total", replica="sg-0", how=how) == 0.0, text
    assert sample(text, "ae_backend_down", replica="sg-0") == 0.0
    assert server.swap_head("v2").ok and server.swap_head("v3").ok and not server.swap_head("v9").ok
    m.refresh([server.status()], 0, 0, 0.0)
    text = m.render().decode()
    assert sample(text, "ae_backend_swaps_total", replica="sg-0", how="session") == 1.0
    assert sample(text, "ae_backend_swaps_total", replica="sg-0", how="restart") == 1.0  # v3: another vocabulary
    assert sample(text, "ae_backend_swaps_total", replica="sg-0", how="refused") == 1.0  # v9: no such version
    assert sample(text, "ae_backend_requests_lost_total", replica="sg-0", reason="aborted") == 0.0

    host, backend, server = sglang_replica(registry, launch=False)
    host.server.touch_target = True  # the update changed the target: undone? not without a server launched here
    assert not server.swap_head("v2").ok
    status = server.status()
    m.refresh([status], 0, 0, 0.0)
    text = m.render().decode()
    assert sample(text, "ae_backend_down", replica="sg-0") == 1.0
    assert "restart the server" in status.info["down"]  # the reason: in the status, never in a label
    assert not any("ae_backend_down{" in line and "restart" in line for line in text.splitlines())
    assert "backend is down" in caplog.text and "restart the server" in caplog.text


def test_backend_counts_keep_their_last_answer_and_a_new_count_is_never_dropped():
    def st(replica, info):
        return ServerStatus(replica=replica, head_version="v1", backend=info.get("backend", "reference"), running=0,
                            waiting=0, served=0, refused=0, failed=0, cancelled=0, info=info)

    m = GatewayMetrics()
    sg = {"backend": "sglang", "down": None, "counts": {"restart_swaps": 2, "broken_streams": 1, "new_thing": 4}}
    m.refresh([st("a", sg), st("ref", {"backend": "reference", "head_version": "v1"})], 0, 0, 0.0)
    m.refresh([], 0, 0, 0.0, replicas_up={"a": False, "ref": True})  # "a" did not answer: its last counts stay
    text = m.render().decode()
    assert sample(text, "ae_backend_swaps_total", replica="a", how="restart") == 2.0
    assert sample(text, "ae_backend_requests_lost_total", replica="a", reason="broken_streams") == 1.0
    assert sample(text, "ae_backend_events_total", replica="a", event="new_thing") == 4.0
    assert 'replica="ref"' not in "\n".join(line for line in text.splitlines() if line.startswith("ae_backend_"))


# ---- time to first token, time per output token, the prefix cache --------------------------------------------
def test_a_response_splits_its_prefill_from_its_decoding_and_the_prefix_cache_is_exported(stack):
    """ttft_s is the replica's time to the first token, tpot_s the time per output token after it; a repeated
    prompt prefills its whole blocks from the prefix cache, counted in the replica's status and /metrics."""
    from dataclasses import replace as replace_config

    from serving.backend import ReferenceBackend
    from serving.messages import DecodeRequest, Finished
    from serving.server import DecodeServer
    from tests.serving.conftest import ENGINE

    engine = stack.engine("v1", replace_config(ENGINE, prefill_block=4))
    server = DecodeServer(ReferenceBackend(engine, stack.registry, 40), name="r0")
    ask = dict(messages=({"role": "user", "content": "one two three four five six seven eight nine"},),
               max_tokens=6)
    first = server.generate(DecodeRequest(request_id="a", **ask))
    again = server.generate(DecodeRequest(request_id="b", **ask))
    for done in (first, again):
        assert isinstance(done, Finished) and done.completion_tokens > 1
        spec = done.spec
        assert spec.ttft_s > 0 and spec.tpot_s > 0
        assert spec.ttft_s + spec.tpot_s * (done.completion_tokens - 1) <= spec.elapsed_s * 1.5 + 0.05
    counts = server.status().info["counts"]
    assert counts["prefix_cache_hits"] == 1 and counts["prefix_cache_hit_tokens"] >= 4
    m = GatewayMetrics()
    m.observe(again.spec, again.completion_tokens)
    m.refresh([server.status()], 0, 0, 0.0)
    text = m.render().decode()
    assert sample(text, "ae_time_to_first_token_seconds_count", head_version="v1") == 1.0
    assert sample(text, "ae_plain_steps_total", head_version="v1") == again.spec.plain_steps
    assert sample(text, "ae_backend_events_total", replica="r0", event="prefix_cache_hit_tokens") == \
        counts["prefix_cache_hit_tokens"]
    # the threads its verify forwards compute on: all of this process's (the threaded kernel is here)
    assert server.status().info["verify_threads"] == torch.get_num_threads()
    assert sample(text, "ae_replica_verify_threads", replica="r0") == torch.get_num_threads()


def test_constrained_requests_a_replica_could_not_finish_are_exported():
    import dataclasses

    m = GatewayMetrics()
    m.refresh([dataclasses.replace(status("r0", None), grammar_failed=3), status("r1", None)], 0, 0, 0.0)
    text = m.render().decode()
    assert 'ae_grammar_failed{replica="r0"} 3.0' in text and 'ae_grammar_failed{replica="r1"} 0.0' in text
