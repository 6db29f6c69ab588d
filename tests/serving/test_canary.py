"""The canary on ONE replica (a 2-core machine runs one): the replica decodes a stable share of
requests with the candidate prepared next to its champion, the very requests the policy's canary takes
(policies.canary: the request id's hash); responses, traces and the live samples report the head each
request used. Also the context check, which now lives in the engine."""


import openai
import pytest

from policies.canary import Canary
from serving.backend import RequestError
from serving.config import ServingConfig
from serving.gateway import GatewayThread, create_app
from serving.messages import DecodeRequest, Finished

MODEL = "tiny-eagle"
PROMPT = "w5 w9 w12 w7 w30"


def request(rid: str, **kw) -> DecodeRequest:
    return DecodeRequest(request_id=rid, messages=({"role": "user", "content": PROMPT},), max_tokens=8, **kw)


def test_a_replica_canary_decodes_its_share_with_the_candidate_losslessly(stack):
    server = stack.server("v1", "solo")
    want = stack.plain_text([{"role": "user", "content": PROMPT}], 8).text
    try:
        res = server.set_canary("v2", 0.5)
        assert res.ok and res.version == "v2" and server.status().info["canary"] == {"version": "v2", "fraction": 0.5}
        ids = [f"req-{i}" for i in range(12)]
        out = {rid: server.generate(request(rid)) for rid in ids}
        assert all(isinstance(f, Finished) and f.text == want for f in out.values())  # lossless on either head
        assert {rid: f.spec.head_version for rid, f in out.items()} == {
            rid: "v2" if Canary("v2", 0.5).takes(rid) else "v1" for rid in ids}  # the policy's decision
        assert server.generate(request("req-0")).spec.head_version == out["req-0"].spec.head_version  # stable
        assert server.generate(request("x", head="v2")).spec.head_version == "v2"  # asked for the candidate
        assert server.head_version == "v1"  # the champion stays installed
        assert server.set_canary("v2", 1.0).ok  # same candidate: only the share changes
        assert server.generate(request("any")).spec.head_version == "v2"
        refused = server.set_canary("v9", 0.5)
        assert not refused.ok and "v9" in refused.message and server.backend.canary.version == "v2"
        assert not server.set_canary("v1", 0.5).ok  # already the installed head
        assert not server.set_canary("v2", 1.5).ok
        assert server.set_canary(None, 0.0).ok and server.backend.canary is None
        assert server.generate(request("req-1")).spec.head_version == "v1"
        assert server.set_canary("v2", 0.5).ok and server.swap_head("v2").ok
        assert server.backend.canary is None  # promoted: the canary's head is the installed one now
    finally:
        server.close()


def test_a_one_replica_gateway_runs_the_policys_canary_inside_the_replica(stack):
    server = stack.server("v1", "solo")
    config = ServingConfig(model_name=MODEL, replicas=1, admin_token="t", max_prompt_tokens=40,
                           max_tokens_limit=64, default_max_tokens=8)
    app = create_app(config, [server])
    thread = GatewayThread(app)
    url = thread.start()
    fleet = app.state.gateway.fleet
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)

        def chat(**kw):
            return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                                  temperature=0, max_tokens=6, **kw).adaptive_eagle

        results = fleet.set_canary("v2", 0.5)  # from a non-loop thread, as the policy controller does
        assert [r.ok for r in results] == [True] and fleet.serving_versions() == ["v1"]
        since = 0.0
        heads = [chat()["head_version"] for _ in range(16)]
        assert set(heads) == {"v1", "v2"}
        assert len(fleet.live_samples("v2", since)) == heads.count("v2")
        assert len(fleet.live_samples("v1", since)) == heads.count("v1")
        assert chat(metadata={"head": "v2"})["head_version"] == "v2"
        with pytest.raises(ValueError, match="champion"):
            fleet.set_canary("v1", 0.5)
        fleet.set_canary(None, 0.0)
        assert app.state.gateway.router.canary is None and server.backend.canary is None
        with pytest.raises(ValueError, match="v9"):
            fleet.set_canary("v9", 0.5)
        assert app.state.gateway.router.canary is None and server.backend.canary is None
        assert {chat()["head_version"] for _ in range(4)} == {"v1"}
        fleet.set_canary("v2", 0.5)
        assert all(r.ok for r in fleet.swap("v2"))  # a swap ends the canary everywhere
        assert app.state.gateway.router.canary is None and server.backend.canary is None
        assert fleet.serving_versions() == ["v2"]
    finally:
        thread.stop()
        server.close()


def test_context_limits_come_from_the_engine_and_name_the_field(stack):
    backend = stack.backend("v1", max_prompt_tokens=None)
    context = stack.target.config.max_position_embeddings
    with pytest.raises(RequestError) as err:
        backend.prepare(request("a").model_copy(update={"max_tokens": context}))
    assert err.value.param == "max_tokens" and err.value.code == "context_length_exceeded"
    long = DecodeRequest(request_id="b", prompt=tuple([7] * context), max_tokens=1)
    with pytest.raises(RequestError) as err:
        backend.prepare(long)
    assert err.value.param == "prompt" and str(context) in err.value.message
    assert len(backend.prepare(request("c"))) == 5


def test_swap_and_canary_preparation_run_below_the_decode_threads_priority(stack):
    """A swap's work (read, check, prepare the head) runs on the replica's swap thread, niced, so it takes
    the cores decoding leaves idle; decoding keeps the process's priority."""
    import os
    import threading

    from serving.server import PREPARE_NICE

    server = stack.server("v1", "solo")
    seen = {}
    backend = server.backend

    def niceness(what, fn):
        def wrapped(*args):
            seen[what] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            return fn(*args)
        return wrapped

    backend.swap_head = niceness("swap", backend.swap_head)
    backend.set_canary = niceness("canary", backend.set_canary)
    backend.stream = niceness("decode", backend.stream)
    try:
        base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert server.set_canary("v2", 0.5).ok and server.swap_head("v2").ok
        assert isinstance(server.generate(request("after")), Finished)
        assert server.head_version == "v2"
        niced = min(19, base + PREPARE_NICE)  # 19: the lowest priority there is
        assert seen == {"swap": niced, "canary": niced, "decode": base}, (seen, base)
    finally:
        server.close()


def test_rollback_and_canary_promotion_are_flips_of_heads_prepared_earlier(stack):
    """The head a swap replaced stays prepared, so swapping back to it (a rollback) loads nothing; a canary's
    head is installed as it was prepared (with what it learnt), not loaded again; any other version is loaded
    from the registry. Outputs stay plain greedy output throughout."""
    backend = stack.backend("v1")
    engine = backend.engine
    want = stack.plain_text([{"role": "user", "content": PROMPT}], 8).text
    server = stack.server("v1", "solo")
    server.backend = backend  # (the server's own backend is replaced by the one the test inspects)

    loads = []
    real_load = backend._load
    backend._load = lambda version: loads.append(version) or real_load(version)
    try:
        v1 = engine.binding
        res = backend.swap_head("v2")
        assert res.ok and "loaded" in res.message and loads == ["v2"]
        v2 = engine.binding
        assert backend.info()["previous_head"] == "v1"
        res = backend.swap_head("v1")  # rollback
        assert res.ok and "flip" in res.message and loads == ["v2"] and engine.binding is v1
        assert backend.info()["previous_head"] == "v2"
        assert backend.swap_head("v1").ok and loads == ["v2"]  # already serving: nothing to do
        assert backend.swap_head("v2").ok and engine.binding is v2 and loads == ["v2"]
        assert backend.swap_head("none").ok and engine.head_version is None and loads == ["v2", "none"]
        assert backend.swap_head("v2").ok and engine.binding is v2  # plain decoding replaced it: still held

        assert backend.set_canary("v1", 0.5).ok and loads == ["v2", "none", "v1"]  # (the previous is plain)
        canary = backend.canary.binding
        assert canary.head is not None and canary.version == "v1"
        res = backend.swap_head("v1")  # the canary promoted: its own binding, nothing loaded again
        assert res.ok and "flip" in res.message and engine.binding is canary and backend.canary is None
        assert loads == ["v2", "none", "v1"]
        refused = backend.swap_head("v9")
        assert not refused.ok and engine.binding is canary and backend.head_version == "v1"
        for version in ("v2", "v1", "none", "v1"):
            assert backend.swap_head(version).ok
            assert server.generate(request(f"after-{version}")).text == want
    finally:
        server.close()

    plain = stack.backend("v1")
    plain.keep_previous = False
    assert plain.swap_head("v2").ok and plain.swap_head("v1").ok and "loaded" in plain.swap_head("v2").message
