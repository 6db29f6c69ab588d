"""Replicas built from a ServingConfig: the starting head (initial_head, else the champion, else plain
decoding), the engine's tree parameters, the capture policy and a store writer the server owns."""

import pytest
from pydantic import ValidationError

from feature_store.config import StoreConfig
from serving.capture import CapturePolicy
from serving.config import EngineParams, ServingConfig
from serving.messages import DecodeRequest, Finished
from serving.replicas import ReplicaBuilder, build_replicas
from tests.serving.conftest import make_target


def config(stack, **kw) -> ServingConfig:
    base = dict(model_name="tiny-eagle", registry_path=str(stack.registry.root), max_prompt_tokens=40,
                engine=EngineParams(depth=3, topk=2, num_draft_tokens=6, cost_aware=False, prompt_lookup=False,
                                    suffix_drafting=False, calibration_dir=""))
    return ServingConfig(**{**base, **kw})


def test_replicas_start_on_the_champion_or_the_initial_head_with_the_configured_tree(stack):
    (plain,) = build_replicas(config(stack), target_builder=make_target)
    try:
        assert stack.registry.champion() == "none" and plain.head_version == "none"
    finally:
        plain.close()
    servers = build_replicas(config(stack, initial_head="v2", replicas=2), target_builder=make_target)
    try:
        assert [s.name for s in servers] == ["replica-0", "replica-1"]
        assert [s.head_version for s in servers] == ["v2", "v2"]
        engine = servers[0].backend.engine
        assert (engine.config.depth, engine.config.topk, engine.config.num_draft_tokens) == (3, 2, 6)
        assert servers[0].backend.max_prompt_tokens == 40 and servers[0].swap_head("v1").ok
        assert servers[0].backend.swap_cpu_share == 0.25  # the configured default
        import gc

        assert gc.get_freeze_count() > 0  # the start-up heap is out of the collector's reach
    finally:
        for s in servers:
            s.close()


def test_a_built_replica_captures_into_its_own_writer_and_closes_it(stack, tmp_path):
    store = StoreConfig(backend="local", local_root=str(tmp_path / "store"), fsync=False)
    server = ReplicaBuilder(config(stack, initial_head="v1", store=store, capture=CapturePolicy(fraction=1.0, seed=0)),
                            "r", 0, make_target)()
    try:
        out = server.generate(DecodeRequest(request_id="a", prompt="w5 w9 w12", max_tokens=6))
        assert isinstance(out, Finished) and out.spec.captured == "hidden" and out.spec.head_version == "v1"
        assert server.writer.flush(10) and server.status().store["written"] == 1
    finally:
        server.close()
    assert server.writer.put(None) is False  # closed with the server: puts are refused, never raised


def test_a_head_that_cannot_load_fails_the_build_and_sglang_needs_its_section(stack):
    with pytest.raises(Exception, match="v9"):
        ReplicaBuilder(config(stack, initial_head="v9"), "r", 0, make_target)()
    with pytest.raises(ValidationError, match="sglang"):
        ServingConfig(backend="sglang")


def test_the_router_is_told_each_replicas_capacity_the_backend_decodes_at_once(stack):
    """A Ray replica's capacity is computed from its config (the router cannot ask a DecodeServer in another
    process before it routes): the reference engine one at a time, SGLang what it batches."""
    from serving.replicas import replica_capacity
    from serving.sglang_backend import SGLangConfig

    (server,) = build_replicas(config(stack), target_builder=make_target)
    try:
        assert replica_capacity(config(stack)) == server.max_inflight == server.status().max_inflight == 1
    finally:
        server.close()
    sg = SGLangConfig(model_path="/m", draft_model_path="/h")
    assert replica_capacity(config(stack, backend="sglang", sglang=sg)) == 48
    assert replica_capacity(config(stack, backend="sglang", sglang=sg.model_copy(
        update={"max_running_requests": 24}))) == 24
    assert replica_capacity(config(stack, backend="sglang", sglang=sg.model_copy(update={"max_inflight": 6}))) == 6
