"""A gateway over two SGLang replicas (each on its own stand-in server, tests/serving/sglang_standin.py) under
many concurrent clients (the official openai client): each replica has many requests in flight at once, a
rolling swap to v2 drains them replica by replica while the other serves (none fails, none straddles two
heads), a canary's share holds with many in flight, and the live samples count every request."""

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from serving.config import ServingConfig
from serving.gateway import GatewayThread, create_app
from serving.server import DecodeServer
from serving.sglang_backend import SGLangBackend, SGLangConfig, launch_sglang
from tests.serving.sglang_standin import StandInHost, WordTokenizer, make_registry

MODEL = "sglang-fleet"


@pytest.fixture(scope="module")
def fleet_app(tmp_path_factory):
    registry = make_registry(tmp_path_factory.mktemp("sglang-fleet") / "registry")
    hosts, servers = [], []
    for i in range(2):
        sg = SGLangConfig(model_path="/models/tiny", draft_model_path=str(registry.get("v1")), weight_version="v1",
                          launch=True, health_poll_s=0.001, startup_timeout_s=5.0, port=30000 + i)
        host = StandInHost()
        client = host.client()
        process = launch_sglang(sg, client=client, spawn=host.spawn)
        host.server.step_s = 0.03
        backend = SGLangBackend(sg, WordTokenizer(), registry, "v1", "fp", client=client, process=process,
                                spawn=host.spawn)
        hosts.append(host)
        servers.append(DecodeServer(backend, name=f"sglang-{i}"))
    config = ServingConfig(model_name=MODEL, replicas=2, queue_size=256, max_tokens_limit=64, default_max_tokens=8,
                           backend="sglang", sglang=sg, request_timeout_s=60)
    app = create_app(config, servers)
    thread = GatewayThread(app)
    url = thread.start()
    yield app, url, hosts, servers
    thread.stop()
    for s in servers:
        s.close()


def _chat(url: str, n: int, clients: int, max_tokens: int = 12) -> list:
    """`n` greedy chat requests from `clients` threads; each answer's adaptive_eagle block, or the exception."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)

    def one(i):
        try:
            return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"w{5 + i} w7"}],
                                                  temperature=0, max_tokens=max_tokens).adaptive_eagle
        except Exception as e:  # noqa: BLE001 - the test counts them
            return e

    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(one, range(n)))


def test_many_in_flight_per_replica_and_a_rolling_swap_under_load_fails_nothing(fleet_app):
    app, url, hosts, servers = fleet_app
    fleet = app.state.gateway.fleet
    for h in hosts:
        h.server.peak_running = 0
    answers, swap = [], {}

    def load():
        answers.extend(_chat(url, 48, 16))

    loader = threading.Thread(target=load)
    loader.start()
    deadline = time.monotonic() + 20
    while sum(h.server.running for h in hosts) < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    swap["results"] = fleet.swap("v2")  # rolling: one replica drained at a time, the other serving
    loader.join(60)
    assert all(r.ok for r in swap["results"]), [r.message for r in swap["results"]]
    failed = [a for a in answers if isinstance(a, Exception)]
    assert len(answers) == 48 and not failed, failed[:3]
    assert all(h.server.peak_running > 1 for h in hosts), [h.server.peak_running for h in hosts]
    assert Counter(a["head_version"] for a in answers).keys() <= {"v1", "v2"}
    straddled = sum(s.backend.info()["counts"]["straddled_requests"] for s in servers)
    assert straddled == 0 and fleet.serving_versions() == ["v2", "v2"]
    assert {a["head_version"] for a in _chat(url, 8, 8)} == {"v2"}


def test_the_canary_share_holds_with_many_requests_in_flight(fleet_app):
    app, url, hosts, _ = fleet_app
    fleet = app.state.gateway.fleet
    if fleet.champion != "v2":
        assert all(r.ok for r in fleet.swap("v2"))
    results = fleet.set_canary("v1", 0.25)  # two replicas: one is swapped to the candidate, a quarter routed there
    assert all(r.ok for r in results), [r.message for r in results]
    since = time.time()
    answers = _chat(url, 160, 24, max_tokens=6)
    assert not [a for a in answers if isinstance(a, Exception)]
    share = Counter(a["head_version"] for a in answers)["v1"] / len(answers)
    assert 0.14 < share < 0.36, share  # 160 draws at 0.25: outside this is < 1% likely
    assert len(fleet.live_samples("v1", since)) + len(fleet.live_samples("v2", since)) == 160
    fleet.set_canary(None, 0.0)
