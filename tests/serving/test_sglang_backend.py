"""The SGLang backend without SGLang: launch arguments, reading meta_info and streams (pure functions), then
the backend's whole path through the protocol-faithful stand-in (tests/serving/sglang_standin.py): generate,
stream in both streaming modes, capture, draft swaps in place and by restart, rollback, verification that
undoes a swap, aborts, a server that dies mid-stream, restarts that fail. The one test that runs SGLang's own
argument parser is skipped, with its reason, where sglang is not installed."""

import threading

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from serving.backend import RequestError
from serving.capture import CapturePolicy
from serving.messages import DecodeRequest, Finished, Refused
from serving.server import DecodeServer
from serving.sglang_backend import SGLangBackend, SGLangConfig, launch_sglang, trace_from_response
from serving.sglang_protocol import (SGLangAborted, SGLangProtocolError, StreamAssembler, finish_reason_of,
                                     served_version, verify_steps_from_meta)
from tests.serving.sglang_standin import StandInHost, WordTokenizer, make_registry

CFG = SGLangConfig(model_path="/models/target", draft_model_path="/heads/v1", num_steps=4, eagle_topk=3,
                   num_draft_tokens=12, port=31000)


# ---- launch arguments ---------------------------------------------------------------------------------
def test_launch_args_ask_for_eagle3_with_the_tree_metrics_label_and_incremental_streams():
    args = CFG.launch_args("python")
    assert args[:3] == ["python", "-m", "sglang.launch_server"]
    pairs = dict(zip(args[3::1], args[4::1]))
    assert pairs["--speculative-algorithm"] == "EAGLE3" and pairs["--speculative-draft-model-path"] == "/heads/v1"
    assert (pairs["--speculative-num-steps"], pairs["--speculative-eagle-topk"],
            pairs["--speculative-num-draft-tokens"]) == ("4", "3", "12")
    assert pairs["--weight-version"] == "v1"  # the head directory's name when no label is given
    assert "--enable-metrics" in args and "--incremental-streaming-output" in args and pairs["--port"] == "31000"
    assert "--tp-size" not in args
    labelled = CFG.model_copy(update={"weight_version": "champion-7", "tp_size": 2}).launch_args("python")
    assert labelled[labelled.index("--weight-version") + 1] == "champion-7"
    assert labelled[labelled.index("--tp-size") + 1] == "2"


@pytest.mark.parametrize("extra", [("--weight-version", "x"), ("--port=1",), ("--speculative-num-steps", "2")])
def test_extra_args_may_not_repeat_a_flag_the_config_sets(extra):
    with pytest.raises(ValidationError, match="extra_args"):
        SGLangConfig(model_path="a", draft_model_path="b", extra_args=extra)


# ---- meta_info and streams -------------------------------------------------------------------------------
def test_meta_info_canonical_names_with_the_correct_drafts_histogram():
    meta = {"completion_tokens": 11, "spec_verify_ct": 4, "spec_accept_length": 2.75,
            "spec_correct_drafts_histogram": [1, 1, 1, 1], "spec_num_proposed_drafts": 44,
            "spec_num_correct_drafts": 6}
    steps = verify_steps_from_meta(meta, 15)
    assert [s.accept_length for s in steps] == [0, 1, 2, 3] and all(s.tree_size == 11 for s in steps)


@pytest.mark.parametrize("meta", [
    {"completion_tokens": 10, "spec_verify_ct": 4, "spec_num_correct_drafts": 6, "spec_num_proposed_drafts": 40},
    {"completion_tokens": 10, "spec_verify_ct": 4, "spec_accepted_drafts": 6, "spec_proposed_drafts": 40},
    {"completion_tokens": 10, "spec_verify_ct": 4, "spec_accept_token_num": 6, "spec_draft_token_num": 40},
    {"completion_tokens": 10, "spec_verify_ct": 4, "spec_accept_length": 2.5},
    {"completion_tokens": 10, "spec_verify_ct": 4},
    # a histogram that disagrees with spec_verify_ct is not used; the counts are
    {"completion_tokens": 10, "spec_verify_ct": 4, "spec_num_correct_drafts": 6, "spec_correct_drafts_histogram": [9]},
])
def test_meta_info_without_a_usable_histogram_keeps_the_mean(meta):
    steps = verify_steps_from_meta(meta, 15)
    assert len(steps) == 4 and sum(s.accept_length for s in steps) == 6
    req = DecodeRequest(request_id="r", prompt=(1, 2), domain="code")
    trace = trace_from_response(req, [1, 2], list(range(10, 20)), meta, "v1", "fp", 15)
    assert trace.accept_length_mean == 2.5 and trace.backend == "sglang" and trace.aux_hidden is None
    assert trace.loss_mask == (0, 0) + (1,) * 10 and trace.domain == "code" and trace.head_version == "v1"


def test_plain_responses_count_one_token_per_step():
    assert [s.accept_length for s in verify_steps_from_meta({"completion_tokens": 3}, 15)] == [0, 0, 0]


def test_the_served_version_is_the_servers_label_unless_it_has_none():
    assert served_version({"weight_version": "v7"}, "v1") == ("v7", False)
    assert served_version({"weight_version": "default"}, "v1") == ("v1", False)
    spans = [{"version": "v1", "start": 0, "end": 3}, {"version": "v2", "start": 3, "end": 9}]
    assert served_version({"weight_version": "v2", "weight_versions": spans}, "v1") == ("v2", True)


def test_an_incremental_chunk_that_repeats_the_output_so_far_is_not_mistaken_for_a_cumulative_one():
    asm = StreamAssembler()
    assert asm.push([7], {"completion_tokens": 1}) == [7]
    assert asm.push([7, 8], {"completion_tokens": 3}) == [7, 8]  # the old guess dropped the second 7 here
    assert asm.mode == "incremental" and asm.tokens == [7, 7, 8]
    assert asm.push([], {"completion_tokens": 3}) == []


def test_cumulative_chunks_are_read_as_cumulative_and_a_chunk_that_fits_no_mode_raises():
    asm = StreamAssembler()
    assert asm.push([5, 6], {"completion_tokens": 2}) == [5, 6]
    assert asm.push([5, 6, 9], {"completion_tokens": 3}) == [9] and asm.mode == "cumulative"
    with pytest.raises(SGLangProtocolError, match="fits no cumulative mode"):
        asm.push([5, 6, 9, 1], {"completion_tokens": 6})
    with pytest.raises(SGLangProtocolError, match="completion_tokens"):
        StreamAssembler().push([1], {})


def test_finish_reasons_and_aborts():
    assert finish_reason_of({"finish_reason": None}) is None
    assert finish_reason_of({"finish_reason": {"type": "length", "length": 4}}) == "length"
    assert finish_reason_of({"finish_reason": {"type": "stop", "matched": 2}}) == "stop"
    with pytest.raises(SGLangAborted, match="out of memory"):
        finish_reason_of({"finish_reason": {"type": "abort", "message": "out of memory", "status_code": None}})
    with pytest.raises(RequestError) as e:
        finish_reason_of({"finish_reason": {"type": "abort", "message": "too long", "status_code": 400}})
    assert e.value.status == 400
    with pytest.raises(SGLangProtocolError):
        finish_reason_of({"finish_reason": {"type": "eos"}})


# ---- the whole path through the stand-in ------------------------------------------------------------------
@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    return make_registry(tmp_path_factory.mktemp("sglang") / "registry")


class Writer:
    def __init__(self):
        self.records = []

    def put(self, trace):
        self.records.append(trace)
        return True

    def stats(self):
        return {"records": len(self.records)}


def replica(registry, capture=None, writer=None, launch=True, **cfg):
    """(stand-in host, backend, replica server) on v1, as serving.replicas builds an SGLang replica."""
    host = StandInHost()
    config = SGLangConfig(model_path="/models/tiny", draft_model_path=str(registry.get("v1")), weight_version="v1",
                          launch=launch, health_poll_s=0.001, startup_timeout_s=5.0, **cfg)
    client = host.client()
    process = launch_sglang(config, client=client, spawn=host.spawn)
    backend = SGLangBackend(config, WordTokenizer(), registry, "v1", "fp", client=client,
                            process=process if launch else None, spawn=host.spawn)
    return host, backend, DecodeServer(backend, capture, writer)


def greedy(host, prompt, n):
    ids, out = list(prompt), []
    for _ in range(n):
        out.append(host.server.next_token(ids + out))
    return out


REQ = DecodeRequest(request_id="r1", prompt="w5 w6 w7", max_tokens=12)


@pytest.mark.parametrize("incremental", [True, False])
def test_generate_streams_the_targets_tokens_with_the_servers_acceptance_and_label(registry, incremental):
    host, backend, server = replica(registry, incremental_streaming=incremental)
    done = server.generate(REQ)
    assert isinstance(done, Finished) and done.finish_reason == "length"
    assert done.text == " ".join(f"w{t}" for t in greedy(host, [5, 6, 7], 12))
    k = host.server.accepted_per_step()
    assert done.spec.head_version == "v1" and done.spec.backend == "sglang"
    assert done.spec.accepted_drafts == 11 - done.spec.verify_steps and done.spec.accept_length == pytest.approx(
        (11 / done.spec.verify_steps), abs=1e-3) and done.spec.verify_steps == -(-11 // (k + 1))
    body = host.log[1][2]
    assert body["sampling_params"]["max_new_tokens"] == 12 and body["input_ids"] == [5, 6, 7] and body["stream"]


def test_captured_records_carry_tokens_the_label_and_per_step_acceptance(registry):
    writer = Writer()
    policy = CapturePolicy(fraction=1.0, low_accept_below=1.0, keep_uncaptured_tokens=True, seed=0)
    host, backend, server = replica(registry, capture=policy, writer=writer)
    server.generate(DecodeRequest(request_id="r2", prompt="w9 w10", max_tokens=9, domain="code"))
    (trace,) = writer.records
    assert trace.backend == "sglang" and trace.head_version == "v1" and trace.domain == "code"
    assert trace.aux_hidden is None and list(trace.input_ids[:2]) == [9, 10] and sum(trace.loss_mask) == 9
    assert sum(s.accept_length + 1 for s in trace.steps) == 8  # the first token came from the prefill


def test_a_swap_loads_the_draft_in_place_checks_the_checksums_and_relabels(registry):
    host, backend, server = replica(registry)
    before_target = host.server.checksum("target")["per_engine_checksum"]
    before_draft = host.server.checksum("draft")["per_engine_checksum"]
    before = server.generate(REQ)
    res = server.swap_head("v2")
    assert res.ok and "in place" in res.message and backend.head_version == "v2"
    assert host.server.checksum("target")["per_engine_checksum"] == before_target
    assert host.server.checksum("draft")["per_engine_checksum"] != before_draft
    paths = [p for _, p, _ in host.log]
    assert paths[paths.index("/begin_weight_update"):paths.index("/end_weight_update") + 1] == [
        "/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"]
    update = next(b for _, p, b in host.log if p == "/update_weights_from_tensor")
    assert update["selector"] == "draft" and update["weight_version"] == "v2" and len(host.launches) == 1
    after = server.generate(REQ)
    assert after.spec.head_version == "v2" and after.text == before.text  # lossless: same tokens, other head
    assert backend.info()["counts"]["session_swaps"] == 1 and backend.info()["last_swap"]["pause_ms"] >= 0
    # rollback: v1 again, in place, and its draft checksum is the one it had at launch
    assert server.swap_head("v1").ok and host.server.checksum("draft")["per_engine_checksum"] == before_draft
    assert server.generate(REQ).spec.head_version == "v1" and len(host.launches) == 1


def test_a_head_with_another_draft_vocabulary_is_served_by_a_restart(registry):
    host, backend, server = replica(registry)
    res = server.swap_head("v3")
    assert res.ok and "restarted" in res.message and "d2t" in res.message
    args = host.launches[-1]
    assert args[args.index("--speculative-draft-model-path") + 1] == str(registry.get("v3"))
    assert args[args.index("--weight-version") + 1] == "v3" and len(host.launches) == 2
    v3_d2t = load_file(str(registry.get("v3") / "model.safetensors"))["d2t"]
    assert torch.equal(host.server.serving_d2t, v3_d2t)  # the new server maps with v3's vocabulary
    assert server.generate(REQ).spec.head_version == "v3" and backend.info()["counts"]["restart_swaps"] == 1
    assert not any(p == "/begin_weight_update" for _, p, _ in host.log)


def test_a_draft_update_never_sends_the_vocabulary_maps_and_the_server_lives_through_swaps_in_a_row(registry):
    """SGLang 0.5.23 dies on a `d2t` in a draft update (the stand-in too, next test): in-place swaps send the
    draft's parameters only, and the same server serves after v2, v1, v2 in a row."""
    host, backend, server = replica(registry)
    for version in ("v2", "v1", "v2"):
        res = server.swap_head(version)
        assert res.ok and "in place" in res.message, res.message
        assert host.server.alive and server.generate(REQ).spec.head_version == version
    sent = [name for name, _ in _names_sent(host)]
    assert sent and not {"d2t", "t2d"} & set(sent) and len(host.launches) == 1
    assert backend.info()["counts"]["session_swaps"] == 3


def _names_sent(host):
    from tests.serving.sglang_standin import _tensors_of

    for _, path, body in host.log:
        if path == "/update_weights_from_tensor":
            yield from _tensors_of(body["serialized_named_tensors"][0])


def test_the_stand_in_dies_on_a_d2t_in_a_draft_update_as_upstream_does(registry):
    """What an update carrying `d2t` does to SGLang 0.5.23 (test_sglang_contract.py reads why from its source):
    the connection drops and the server is gone."""
    import httpx

    from serving.sglang_protocol import tensor_update_bodies
    from serving.sglang_swap import DraftWeights, WeightSession

    host, backend, _ = replica(registry)
    weights = DraftWeights.read(registry.get("v2"))
    session = WeightSession(backend.client)
    assert session._step("begin_update", {"selector": "draft"}) is None
    body = tensor_update_bodies({"d2t": weights.tensors["d2t"]}, "v2", 1, 1 << 20)[-1]
    with pytest.raises(httpx.RemoteProtocolError):
        backend.client.post("/update_weights_from_tensor", json=body)
    assert not host.server.alive
    with pytest.raises(httpx.ConnectError):
        backend.client.get("/health")


def test_swaps_by_configuration_restart_and_none_or_unknown_versions_are_refused(registry):
    host, backend, server = replica(registry, swap="restart")
    assert server.swap_head("v2").ok and len(host.launches) == 2
    for version in ("none", "v9"):
        res = server.swap_head(version)
        assert not res.ok and res.version == "v2" and backend.head_version == "v2"
    assert server.swap_head("v2").message.startswith("v2 already serving")


def test_an_update_the_draft_ignores_is_undone_in_place_and_refused_without_a_launched_server(registry):
    host, backend, server = replica(registry, launch=False)
    host.server.ignore_draft_updates = True  # success, nothing loaded: names the draft's loader skips
    res = server.swap_head("v2")
    assert not res.ok and "did not change" in res.message and "sglang.launch: true" in res.message
    assert backend.head_version == "v1" and backend.info()["down"] is None
    assert server.generate(REQ).spec.head_version == "v1"  # the label went back with the undo


def test_an_update_that_changes_the_target_is_undone_by_a_restart(registry):
    host, backend, server = replica(registry)
    host.server.touch_target = True
    res = server.swap_head("v2")
    assert res.ok and "restarted" in res.message and "target's checksum changed" in res.message
    assert len(host.launches) == 2 and server.generate(REQ).spec.head_version == "v2"


def test_an_update_that_changes_the_target_of_a_server_not_launched_here_takes_it_out_of_service(registry):
    host, backend, server = replica(registry, launch=False)
    host.server.touch_target = True
    assert not server.swap_head("v2").ok and "restart the server" in backend.info()["down"]
    refused = server.generate(REQ)
    assert isinstance(refused, Refused) and refused.status == 500 and "down" in refused.message


def test_a_draft_checksum_that_differs_from_the_one_seen_for_the_version_is_refused(registry):
    host, backend, server = replica(registry, launch=False)
    assert server.swap_head("v2").ok and backend._draft_sums["v1"]  # the launch head's, taken on the first swap
    backend._draft_sums["v1"] = "0" * 64  # as if v1's weights had loaded differently before
    res = server.swap_head("v1")
    assert not res.ok and "while serving v1 before" in res.message and backend.head_version == "v2"
    assert server.generate(REQ).spec.head_version == "v2"


def test_moe_heads_are_refused_before_anything_is_sent(registry, tmp_path):
    import json
    import shutil

    from serving.sglang_swap import DraftWeights

    moe = tmp_path / "moe"
    shutil.copytree(registry.get("v1"), moe)
    cfg = json.loads((moe / "config.json").read_text())
    cfg["architectures"] = ["AdaptiveEagleMoEForCausalLMEagle3"]
    cfg["adaptive_eagle"]["num_experts"] = 2
    (moe / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="MoE"):
        DraftWeights.read(moe)


def test_a_session_left_open_is_closed_before_the_swap(registry):
    host, backend, server = replica(registry)
    host.server.session = "draft"
    assert server.swap_head("v2").ok and host.server.session is None and len(host.launches) == 1


def test_a_swap_waits_for_the_request_in_flight_and_holds_new_ones(registry):
    host, backend, server = replica(registry)
    events = server.stream(DecodeRequest(request_id="r3", prompt="w5", max_tokens=30))
    next(events), next(events)  # Started, then the first tokens: the request is in flight
    result = {}
    swapper = threading.Thread(target=lambda: result.update(res=backend.swap_head("v2")))
    swapper.start()
    swapper.join(0.3)
    assert swapper.is_alive()  # held until the request finishes
    last = list(events)[-1]
    swapper.join(10)
    assert isinstance(last, Finished) and last.spec.head_version == "v1" and result["res"].ok
    assert backend.info()["last_swap"]["drain_ms"] > 0


def test_an_abort_is_an_error_for_the_client_and_counted(registry):
    host, backend, server = replica(registry)
    host.server.abort = ("the scheduler ran out of memory", None)
    refused = server.generate(REQ)
    assert isinstance(refused, Refused) and refused.status == 500 and "out of memory" in refused.message
    assert server.status().failed == 1 and backend.info()["counts"]["aborted"] == 1
    host.server.abort = ("input is longer than the context", 400)
    refused = server.generate(REQ)
    assert isinstance(refused, Refused) and refused.status == 400 and server.status().refused == 1
    host.server.abort, host.server.error_chunk = None, ("bad sampling", 400)
    assert isinstance(server.generate(REQ), Refused) and backend.info()["counts"]["refused_by_sglang"] == 2


def test_a_server_that_dies_mid_stream_fails_the_request_and_a_swap_brings_it_back(registry):
    host, backend, server = replica(registry)
    host.server.die_after = 1
    refused = server.generate(REQ)
    assert isinstance(refused, Refused) and refused.status == 500 and "stopped answering" in refused.message
    again = server.generate(REQ)
    assert isinstance(again, Refused) and backend.info()["counts"]["broken_streams"] == 2
    res = server.swap_head("v2")  # the session gets no answer: a restart on v2
    assert res.ok and "restarted" in res.message and server.generate(REQ).spec.head_version == "v2"


def test_a_restart_that_fails_goes_back_to_the_previous_head(registry):
    host, backend, server = replica(registry)
    host.failing_launches = 1
    res = server.swap_head("v3")
    assert not res.ok and "restart failed" in res.message and backend.head_version == "v1"
    args = host.launches[-1]
    assert args[args.index("--weight-version") + 1] == "v1" and len(host.launches) == 3
    assert server.generate(REQ).spec.head_version == "v1"


def test_when_both_restarts_fail_the_replica_refuses_requests_until_a_swap_succeeds(registry):
    host, backend, server = replica(registry)
    host.failing_launches = 2
    assert not server.swap_head("v3").ok and backend.info()["down"]
    assert isinstance(server.generate(REQ), Refused)
    assert server.swap_head("v3").ok and server.generate(REQ).spec.head_version == "v3"


# SGLang's own parser on our launch arguments: never importable here (SGLang needs a GPU), so the arguments are
# checked against the 0.5.23 wheel's source (tests/serving/test_sglang_contract.py
# test_every_launch_flag_is_a_server_argument_with_the_right_arity, which runs in every `make test`), and SGLang
# itself starts on them in ops/gpu_check.sh on a GPU machine.


def test_the_policy_refuses_a_moe_candidate_for_sglang_replicas_before_any_swap(tmp_path):
    """A MoE-routed candidate never reaches an SGLang replica: the policy asks the gateway's fleet first and
    rejects it with the reason (no gate, no canary, no swap, no restart); a dense one is servable."""
    import dataclasses

    from adaptive_eagle.checkpoint import HeadMeta, read_config
    from adaptive_eagle.draft_head import Eagle3DraftHead, init_weights
    from adaptive_eagle.targets import tiny_target
    from policies.controller import PolicyController
    from policies.gates import REJECT
    from policies.log import PromotionLog
    from policies.samples import RequestSample
    from serving.config import ServingConfig
    from serving.gateway import Gateway

    registry = make_registry(tmp_path / "registry")
    target = tiny_target(seed=5, vocab_size=64, hidden_size=32, num_layers=4)  # make_registry's target
    head = Eagle3DraftHead(dataclasses.replace(read_config(registry.get("v1")), num_experts=2, num_experts_per_tok=1))
    init_weights(head, std=0.1)
    head.set_draft_vocab(torch.arange(4, 44))
    registry.register(head, HeadMeta.new("m1", target.name, target.fingerprint), dtype=torch.float32)
    host, backend, server = replica(registry)
    config = ServingConfig(model_name="m", replicas=1, backend="sglang", sglang=backend.cfg,
                           registry_path=str(registry.root))
    fleet = Gateway(config, [server]).fleet
    assert fleet.cannot_serve("v2") is None and "MoE-routed head (2 experts)" in fleet.cannot_serve("m1")
    assert Gateway(config.model_copy(update={"registry_path": None}), [server]).fleet.cannot_serve("m1") is None

    plog = PromotionLog(tmp_path / "promotions.jsonl")
    controller = PolicyController(registry, fleet, plog)
    samples = [RequestSample(accept_length=2.0 + i % 3, head_version="v1", request_id=f"r{i}") for i in range(200)]
    better = [dataclasses.replace(s, accept_length=s.accept_length + 1, head_version="m1") for s in samples]
    decision = controller.consider("m1", samples, better)
    assert decision.action == REJECT and "m1 cannot serve on this fleet" in decision.reason
    assert "dense MLP" in decision.reason and controller.state == "idle"
    [line] = plog.read().events
    assert line.event == "considered" and line.action == REJECT and "MoE" in line.reason
    assert backend.head_version == "v1" and len(host.launches) == 1 and host.server.session is None
