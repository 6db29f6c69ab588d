"""A replica that fails while serving a request (its Ray actor died: a crash, the OOM killer, `ray kill`) gives
the client a clean OpenAI-style error, never a bare 500, a reset connection or a hang: before the replica produced
anything the request is retried once on another replica; after, a 503 `replica_unavailable`, or after a stream's
200 an SSE error event and `[DONE]`. Stand-in replicas pin each case down; one test kills a real ServerActor
mid-request and sees Ray's restart serve again."""

import asyncio
import functools
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.actor import remote_server_actor
from serving.config import ServingConfig
from serving.gateway import GatewayThread, create_app
from serving.messages import Delta, Finished, ServerStatus, SpecMetrics, Started
from serving.server import DecodeServer

MODEL = "tiny-eagle"
CHAT = "/v1/chat/completions"
HANG_S = 300.0  # deadlines that only stop a hang: a loaded machine builds and restarts actors slowly


class ReplicaDied(Exception):
    """What a Ray streaming generator raises when its actor dies (ray.exceptions.ActorUnavailableError)."""


class StandIn:
    """A replica without a model. `fail`: "before" raises before its first event, "silent" never produces one,
    "after" raises after a Delta,
    "never" serves "hello world"; "hang" stalls after its Delta until the gateway closes the stream."""

    def __init__(self, name: str, fail: str = "never") -> None:
        self.name, self.fail = name, fail
        self.calls = 0
        self.closed = threading.Event()

    async def stream(self, request):
        self.calls += 1
        try:
            if self.fail == "before":
                raise ReplicaDied(f"{self.name} died")
            if self.fail == "silent":  # a Ray actor that was never placed: its calls wait, without an error
                await asyncio.Event().wait()
            yield Started(request.request_id, 3, self.name)
            yield Delta("hello")
            if self.fail == "after":
                raise ReplicaDied(f"{self.name} died")
            if self.fail == "hang":
                await asyncio.Event().wait()
            yield Delta(" world")
            spec = SpecMetrics(head_version="none", accept_length=1.0, verify_steps=2, draft_tokens=0,
                               accepted_drafts=0, replica=self.name)
            yield Finished(request.request_id, "hello world", "length", 3, 2, spec)
        finally:
            self.closed.set()

    async def status(self) -> ServerStatus:
        return ServerStatus(replica=self.name, head_version="none", backend="stand-in", running=0, waiting=0,
                            served=0, refused=0, failed=0, cancelled=0)


def config(replicas: int, **kw) -> ServingConfig:
    return ServingConfig(model_name=MODEL, replicas=replicas, admin_token="t", max_tokens_limit=64,
                         default_max_tokens=16, **kw)


def chat_body(stream: bool = False, domain=None, max_tokens: int = 16) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "w5 w9 w12 w7 w30"}], "temperature": 0,
            "max_tokens": max_tokens, "stream": stream, **({"metadata": {"domain": domain}} if domain else {})}


def sample(http: httpx.Client, name: str, **labels) -> float:
    """One sample of the gateway's /metrics (0.0 when the series does not exist)."""
    text = http.get("/metrics").text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def sse_data(lines) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def text_of(data: str) -> str:
    """The text an SSE chat chunk carries ("" for the role chunk, an error or [DONE])."""
    chunk = json.loads(data) if data != "[DONE]" else {}
    return "".join(c["delta"].get("content") or "" for c in chunk.get("choices", []))


def wait_until(pred, timeout: float = HANG_S):
    deadline = time.monotonic() + timeout
    while not (v := pred()):
        assert time.monotonic() < deadline, f"still false after {timeout} s: {pred}"
        time.sleep(0.05)
    return v


@pytest.fixture
def serve():
    """serve(*replicas) -> an httpx client on a gateway over them (stopped after the test)."""
    threads, clients = [], []

    def start(*replicas, **kw):
        thread = GatewayThread(create_app(config(len(replicas), **kw), list(replicas)))
        threads.append(thread)
        clients.append(httpx.Client(base_url=thread.start(), timeout=60))
        return clients[-1]

    yield start
    for c in clients:
        c.close()
    for t in threads:
        t.stop()


# ---- stand-in replicas ----------------------------------------------------------------------------------------


def test_a_replica_failing_before_its_first_event_is_retried_once_on_another_replica(serve):
    broken, good = StandIn("broken", "before"), StandIn("good")
    http = serve(broken, good)  # the router leases the first free slot: the broken replica
    resp = http.post(CHAT, json=chat_body())
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == "hello world"
    with http.stream("POST", CHAT, json=chat_body(stream=True)) as stream:
        data = sse_data(stream.iter_lines())
    assert stream.status_code == 200 and data[-1] == "[DONE]"
    assert "".join(map(text_of, data)) == "hello world"
    assert (broken.calls, good.calls) == (1, 2)  # after its failure the broken replica is routed to last
    assert sample(http, "ae_replica_failures_total", replica="broken") == 1
    assert sample(http, "ae_replica_failures_total", replica="good") == 0
    assert sample(http, "ae_requests_total", endpoint=CHAT, status="200") == 2


def test_a_replica_that_never_starts_the_request_is_a_failure_not_a_hang(serve):
    """A replica actor Ray could not place (its node never joined) holds every call without an error: the
    request is retried on the other replica after first_event_timeout_s, the silent one is passed over after
    that, and alone it answers a 503 instead of hanging."""
    silent, good = StandIn("silent", "silent"), StandIn("good")
    http = serve(silent, good, first_event_timeout_s=0.5)
    t0 = time.monotonic()
    answers = [http.post(CHAT, json=chat_body()) for _ in range(3)]
    assert [r.status_code for r in answers] == [200] * 3 and time.monotonic() - t0 < 10
    assert silent.calls == 1 and good.calls == 3  # once, then passed over while it stays silent
    assert sample(http, "ae_replica_failures_total", replica="silent") == 1
    alone = StandIn("alone", "silent")
    http = serve(alone, first_event_timeout_s=0.5)
    resp = http.post(CHAT, json=chat_body())
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "replica_unavailable"
    assert "ReplicaSilent" in resp.json()["error"]["message"]


def test_a_failed_replica_is_routed_to_last_until_it_answers_again(serve):
    """An idle replica whose node is gone has the least load: without the cool-down it would take, and fail,
    the first try of every new request. It is routed to last until it serves or answers its status again."""
    broken, good = StandIn("broken", "before"), StandIn("good")
    broken.status = _silent_status
    http = serve(broken, good)
    for _ in range(4):
        assert http.post(CHAT, json=chat_body()).status_code == 200
    # tried at most once (the gateway's start-up status round may have found it silent already), never again
    assert broken.calls <= 1 and good.calls == 4
    assert sample(http, "ae_replica_up", replica="broken") == 0  # the scrape asked it: still silent
    assert http.get("/admin/status", headers={"Authorization": "Bearer t"}).json()["suspect_replicas"] == ["broken"]
    broken.fail, broken.status = "never", StandIn("x").status  # its node came back
    assert sample(http, "ae_replica_up", replica="broken") == 1  # answered: healthy again
    calls = broken.calls
    assert http.post(CHAT, json=chat_body()).status_code == 200 and broken.calls == calls + 1  # idle: first again
    assert http.get("/admin/status", headers={"Authorization": "Bearer t"}).json()["suspect_replicas"] == []


async def _silent_status():
    raise ReplicaDied("status: the actor is gone")


def test_a_retry_without_another_replica_or_failing_again_answers_503(serve):
    alone = StandIn("alone", "before")
    http = serve(alone)
    resp = http.post(CHAT, json=chat_body())
    err = resp.json()["error"]
    assert resp.status_code == 503 and err["code"] == "replica_unavailable" and err["type"] == "server_error"
    assert "alone" in err["message"] and "retry" in err["message"] and resp.headers["retry-after"] == "1"
    assert alone.calls == 1  # no other replica: not retried on the one that just failed

    first, second = StandIn("first", "before"), StandIn("second", "before")
    http = serve(first, second)
    resp = http.post(CHAT, json=chat_body())
    assert resp.status_code == 503 and "second" in resp.json()["error"]["message"]
    assert (first.calls, second.calls) == (1, 1)  # retried once, never more
    assert sample(http, "ae_replica_failures_total", replica="first") == 1
    assert sample(http, "ae_replica_failures_total", replica="second") == 1
    assert sample(http, "ae_requests_total", endpoint=CHAT, status="503") == 1


def test_a_replica_failing_after_a_delta_answers_503_or_an_sse_error_event_and_is_not_replayed(serve):
    flaky, good = StandIn("flaky", "after"), StandIn("good")
    http = serve(flaky, good)
    resp = http.post(CHAT, json=chat_body())
    err = resp.json()["error"]
    assert resp.status_code == 503 and err["code"] == "replica_unavailable" and "flaky" in err["message"]
    http.get("/metrics")  # flaky answers its status: healthy again, first of the two idle replicas again
    with http.stream("POST", CHAT, json=chat_body(stream=True)) as stream:
        data = sse_data(stream.iter_lines())  # a reset connection would raise here
    assert stream.status_code == 200 and data[-1] == "[DONE]"
    assert "".join(map(text_of, data)) == "hello"
    err = json.loads(data[-2])["error"]
    assert err["code"] == "replica_unavailable" and "flaky" in err["message"] and "retry" in err["message"]
    assert (flaky.calls, good.calls) == (2, 0)  # tokens were decoded: never replayed elsewhere
    http.get("/metrics")
    assert http.post(CHAT, json=chat_body()).status_code == 503  # the same connection still answers
    assert sample(http, "ae_replica_failures_total", replica="flaky") == 3
    assert sample(http, "ae_requests_total", endpoint=CHAT, status="503") == 3


def test_a_client_leaving_a_stream_is_not_a_replica_failure(serve):
    hang = StandIn("hang", "hang")
    http = serve(hang)
    with http.stream("POST", CHAT, json=chat_body(stream=True)) as stream:
        lines = stream.iter_lines()
        while '"hello"' not in next(lines):
            pass
    # leaving the block closed the connection: the gateway cancels the stream, which closes the replica's
    assert hang.closed.wait(HANG_S)
    assert sample(http, "ae_replica_failures_total", replica="hang") == 0
    assert sample(http, "ae_requests_total", endpoint=CHAT, status="503") == 0


# ---- a real ServerActor, killed mid-request ----------------------------------------------------------------


class StallingServer(DecodeServer):
    """A request tagged with a domain starting "stall" stops after its first Delta until it is cancelled or its
    process is killed, and says so with the file <marks>/<domain>: the test kills its actor while it is in flight,
    with no timing guess."""

    def __init__(self, *args, marks: str, **kw) -> None:
        super().__init__(*args, **kw)
        self.marks = Path(marks)

    def stream(self, request, cancel=None):
        cancel = cancel or threading.Event()
        stall = (request.domain or "").startswith("stall")
        for event in super().stream(request, cancel):
            yield event  # the caller posts it to the gateway before asking for the next one
            if stall and isinstance(event, Delta):
                (self.marks / request.domain).touch()
                cancel.wait()


def build(registry_root: str, name: str, marks: str):
    """Runs inside the actor's process. An actor Ray restarts waits for the file <marks>/restart before it builds
    its server, so the test reads /metrics while the replica is surely down."""
    import ray

    from adaptive_eagle.registry import HeadRegistry
    from serving.capture import CapturePolicy
    from tests.serving.conftest import Stack, make_target

    if ray.get_runtime_context().was_current_actor_reconstructed:
        while not (Path(marks) / "restart").exists():  # no deadline: the test opens it, or kills the actor
            time.sleep(0.05)
    backend = Stack(make_target(), HeadRegistry(registry_root)).backend("v1")
    return StallingServer(backend, CapturePolicy(enabled=False), name=name, marks=marks)


def test_a_replica_actor_killed_mid_request_answers_cleanly_and_serves_again_after_its_restart(
        ray_session, stack, tmp_path):
    ray = ray_session
    replica = remote_server_actor(functools.partial(build, str(stack.registry.root), "actor-0", str(tmp_path)),
                                  "actor-0", num_cpus=0, max_restarts=2, max_task_retries=0)  # as stack.py does
    thread = GatewayThread(create_app(config(1), [replica]))
    want = stack.plain_text(chat_body()["messages"], 16).text
    try:
        with httpx.Client(base_url=thread.start(), timeout=HANG_S) as http:
            # a stream in flight: its first words reached the client, then its actor is killed
            with http.stream("POST", CHAT, json=chat_body(stream=True, domain="stall-stream")) as stream:
                lines = stream.iter_lines()
                data = []
                while not any(text_of(d) for d in data):
                    data += sse_data([next(lines)])
                ray.kill(replica.handle, no_restart=False)
                data += sse_data(lines)  # a reset connection would raise here
            err = json.loads(data[-2])["error"]
            assert data[-1] == "[DONE]" and err["code"] == "replica_unavailable" and "actor-0" in err["message"]
            # down: Ray restarts the actor, which waits for the restart file
            assert sample(http, "ae_replica_up", replica="actor-0") == 0
            assert sample(http, "ae_replica_failures_total", replica="actor-0") == 1
            (tmp_path / "restart").touch()
            wait_until(lambda: sample(http, "ae_replica_up", replica="actor-0") == 1)
            resp = http.post(CHAT, json=chat_body())
            assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == want

            # a non-streamed request in flight, killed: a 503 on the same connection, then served again
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(http.post, CHAT, json=chat_body(domain="stall-plain"))
                wait_until((tmp_path / "stall-plain").exists)
                ray.kill(replica.handle, no_restart=False)
                resp = pending.result(HANG_S)
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "replica_unavailable"
            wait_until(lambda: sample(http, "ae_replica_up", replica="actor-0") == 1)
            resp = http.post(CHAT, json=chat_body())
            assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == want
            assert sample(http, "ae_replica_failures_total", replica="actor-0") == 2
            assert sample(http, "ae_requests_total", endpoint=CHAT, status="503") == 2
    finally:
        thread.stop()
        ray.kill(replica.handle, no_restart=True)
