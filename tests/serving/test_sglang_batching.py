"""An SGLang replica serves many requests at once (SGLang batches them), through the stand-in's scheduler
(tests/serving/sglang_standin.py: up to --max-running-requests decode at once, 48 by default for EAGLE-3):
N requests in flight on one replica, every output still the target's, capture of every one of them, a bound
that holds, and a swap that drains them as SGLang's own weight-update lock does (none straddles two heads)."""

import threading
import time

import pytest

from serving.capture import CapturePolicy
from serving.messages import DecodeRequest, Finished
from serving.sglang_backend import SGLangConfig
from tests.serving.sglang_standin import make_registry
from tests.serving.test_sglang_backend import Writer, greedy, replica


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    return make_registry(tmp_path_factory.mktemp("sglang-batch") / "registry")


def _request(i: int, n: int = 10) -> DecodeRequest:
    return DecodeRequest(request_id=f"b{i}", prompt=f"w{5 + i} w{6 + i} w7", max_tokens=n)


def _concurrently(server, requests):
    """server.generate of every request, each on its own thread at once; the answers in request order."""
    out = [None] * len(requests)

    def run(i):
        out[i] = server.generate(requests[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a request hung"
    return out


def test_the_default_limit_is_what_sglang_batches_and_a_set_one_is_passed_to_sglang():
    cfg = SGLangConfig(model_path="m", draft_model_path="h")
    assert cfg.inflight_limit == 48 and "--max-running-requests" not in cfg.launch_args()
    run32 = cfg.model_copy(update={"max_running_requests": 32})
    assert run32.inflight_limit == 32
    args = run32.launch_args()
    assert args[args.index("--max-running-requests") + 1] == "32"
    assert cfg.model_copy(update={"max_inflight": 8, "max_running_requests": 32}).inflight_limit == 8
    with pytest.raises(ValueError, match="extra_args"):
        SGLangConfig(model_path="m", draft_model_path="h", extra_args=("--max-running-requests", "4"))


def test_sixteen_requests_are_in_flight_at_once_on_one_replica_and_each_is_the_targets_and_captured(registry):
    writer = Writer()
    policy = CapturePolicy(fraction=1.0, low_accept_below=1.0, keep_uncaptured_tokens=True, seed=0)
    host, backend, server = replica(registry, capture=policy, writer=writer)
    host.server.step_s = 0.15  # every verify step takes this long: the requests overlap for sure
    assert server.max_inflight == 48 and server.status().max_inflight == 48
    requests = [_request(i) for i in range(16)]
    t0 = time.perf_counter()
    answers = _concurrently(server, requests)
    wall = time.perf_counter() - t0
    assert host.server.peak_running == 16  # the replica passed all 16 through to SGLang's batch
    for i, done in enumerate(answers):
        assert isinstance(done, Finished), done
        assert done.text == " ".join(f"w{t}" for t in greedy(host, [5 + i, 6 + i, 7], 10))
    steps = answers[0].spec.verify_steps + 1  # the prefill's chunk too
    assert wall < 16 * steps * host.server.step_s / 3  # batched, not one after another
    assert sorted(r.request_id for r in writer.records) == sorted(r.request_id for r in requests)
    assert server.status().served == 16 and server.status().running == 0


def test_the_replica_never_sends_more_than_max_inflight_at_once(registry):
    host, backend, server = replica(registry, max_inflight=3)
    host.server.step_s = 0.05
    answers = _concurrently(server, [_request(i, 6) for i in range(9)])
    assert all(isinstance(a, Finished) for a in answers)
    assert host.server.peak_running == 3 and server.max_inflight == 3


def test_a_swap_drains_the_requests_in_flight_and_new_ones_wait_for_it(registry):
    """Eight requests stream while a swap to v2 comes: the update opens only once all eight finished (the
    stand-in's lock would refuse nothing, so the order is read from its log), each request is served by one
    head, and the requests after the swap are served by v2."""
    host, backend, server = replica(registry)
    host.server.step_s = 0.1
    answers, swap = [None] * 8, {}

    def run(i):
        answers[i] = server.generate(_request(i))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while host.server.running < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert host.server.running == 8
    swapper = threading.Thread(target=lambda: swap.update(res=server.swap_head("v2")))
    swapper.start()
    for t in threads + [swapper]:
        t.join(60)
    assert swap["res"].ok, swap["res"].message
    assert {a.spec.head_version for a in answers} == {"v1"} and backend.info()["counts"]["straddled_requests"] == 0
    paths = [p for _, p, _ in host.log]
    begin = paths.index("/begin_weight_update")
    assert paths[:begin].count("/generate") == 8  # all eight were sent before the update opened
    assert "/generate" not in paths[begin:paths.index("/end_weight_update")]  # and none during the update
    assert backend.last_swap["drain_ms"] > 0
    after = _concurrently(server, [_request(i) for i in range(8, 12)])
    assert {a.spec.head_version for a in after} == {"v2"}
