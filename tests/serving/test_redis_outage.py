"""Redis stopped mid-load: the gateway keeps answering every request (capture never blocks or
raises), the writer counts what it dropped, and capture resumes once Redis is back."""

import threading
import time

import openai

from feature_store.config import StoreConfig
from feature_store.writer import StoreWriter
from serving.capture import CapturePolicy
from serving.config import ServingConfig
from serving.gateway import GatewayThread, create_app
from tests.feature_store.conftest import free_port, spawn_redis

MODEL = "tiny-eagle"


def test_requests_succeed_while_redis_is_down_and_capture_resumes_after(stack, tmp_path):
    port = free_port()
    redis = spawn_redis(port, tmp_path / "redis")
    writer = StoreWriter(StoreConfig(backend="redis", redis_url=f"redis://127.0.0.1:{port}/0", key_prefix="outage",
                                     flush_interval_s=0.01, backoff_initial_s=0.02, backoff_max_s=0.2,
                                     queue_max_records=4, socket_timeout_s=0.5))  # a small queue: drops show soon
    server = stack.server("v1", "solo", CapturePolicy(fraction=1.0, seed=0), writer)
    thread = GatewayThread(create_app(ServingConfig(model_name=MODEL, replicas=1, queue_size=8, max_prompt_tokens=40,
                                                    max_tokens_limit=64, default_max_tokens=8), [server]))
    url = thread.start()
    failures, answered, stop = [], [], threading.Event()

    def load(k: int) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        while not stop.is_set():
            try:
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"w{5 + k} w9 w12"}],
                                               temperature=0, max_tokens=6)
                answered.append(time.monotonic())
            except Exception as e:  # noqa: BLE001 - every failure is the test's finding
                failures.append(repr(e))

    clients = [threading.Thread(target=load, args=(k,)) for k in range(2)]
    try:
        for c in clients:
            c.start()
        assert wait(lambda: writer.stats().written >= 3)
        redis.terminate()
        redis.wait(10)
        down = len(answered)
        assert wait(lambda: writer.stats().dropped >= 3)  # captures dropped and counted, requests go on
        assert len(answered) > down
        redis = spawn_redis(port, tmp_path / "redis")
        written = writer.stats().written
        assert wait(lambda: writer.stats().written > written + 2)  # reconnected: capture resumes
    finally:
        stop.set()
        for c in clients:
            c.join(60)
        thread.stop()
        server.close()
        writer.close()
        redis.terminate()
        redis.wait(10)
    assert failures == []


def wait(predicate, timeout_s: float = 180.0) -> bool:
    """Poll until `predicate` holds. The deadline only stops a hung test: on a loaded 2-core machine a request
    to the tiny target has taken 15 s, so the verdict is whether the event happens, never how soon."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())
