"""The SGLang backend without SGLang: launch arguments, meta_info parsing (new and old field names),
streaming /generate and the draft-only weight update over a mocked HTTP server. The one test that
runs SGLang's own argument parser is skipped, with its reason, where sglang is not installed."""

import json

import httpx
import pytest
from pydantic import ValidationError

from serving.messages import DecodeRequest
from serving.server import DecodeServer
from serving.sglang_backend import SGLangBackend, SGLangConfig, trace_from_response, verify_steps_from_meta

CFG = SGLangConfig(model_path="/models/target", draft_model_path="/heads/v1", num_steps=4, eagle_topk=3,
                   num_draft_tokens=12, port=31000)


def test_launch_args_ask_for_eagle3_with_the_tree_and_metrics():
    args = CFG.launch_args("python")
    assert args[:3] == ["python", "-m", "sglang.launch_server"]
    pairs = dict(zip(args[3::1], args[4::1]))
    assert pairs["--speculative-algorithm"] == "EAGLE3" and pairs["--speculative-draft-model-path"] == "/heads/v1"
    assert (pairs["--speculative-num-steps"], pairs["--speculative-eagle-topk"],
            pairs["--speculative-num-draft-tokens"]) == ("4", "3", "12")
    assert "--enable-metrics" in args and pairs["--port"] == "31000"


def test_the_all_selector_is_refused():
    with pytest.raises(ValidationError):
        SGLangConfig(model_path="a", draft_model_path="b", weight_selector="all")


def test_meta_info_new_names_with_a_histogram():
    meta = {"completion_tokens": 10, "spec_verify_ct": 4, "spec_accept_length": 2.5,
            "spec_accept_histogram": [1, 1, 1, 1], "spec_proposed_drafts": 48}
    steps = verify_steps_from_meta(meta, 16)
    assert [s.accept_length for s in steps] == [0, 1, 2, 3] and all(s.tree_size == 12 for s in steps)
    assert sum(s.accept_length + 1 for s in steps) == 10


@pytest.mark.parametrize("meta", [
    {"completion_tokens": 10, "spec_verify_ct": 4, "spec_accept_token_num": 6, "spec_draft_token_num": 40},
    {"completion_tokens": 10, "spec_verify_ct": 4, "spec_accept_length": 2.5},
    {"completion_tokens": 10, "spec_verify_ct": 4},
])
def test_meta_info_without_a_histogram_keeps_the_mean(meta):
    steps = verify_steps_from_meta(meta, 16)
    assert len(steps) == 4 and sum(s.accept_length for s in steps) == 6
    req = DecodeRequest(request_id="r", prompt=(1, 2), domain="code")
    trace = trace_from_response(req, [1, 2], list(range(10, 20)), meta, "v1", "fp", 16)
    assert trace.accept_length_mean == 2.5 and trace.backend == "sglang" and trace.aux_hidden is None
    assert trace.loss_mask == (0, 0) + (1,) * 10 and trace.domain == "code" and trace.head_version == "v1"


def test_plain_responses_count_one_token_per_step():
    assert [s.accept_length for s in verify_steps_from_meta({"completion_tokens": 3}, 16)] == [0, 0, 0]


class WordTokenizer:
    def __call__(self, text):
        return {"input_ids": [int(w[1:]) for w in text.split()]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids)


class FakeRegistry:
    def get(self, version):
        if version != "v2":
            raise KeyError(f"no such version {version}")
        return f"/registry/{version}"


def fake_sglang(calls):
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        calls.append((request.url.path, body))
        if request.url.path == "/generate":
            chunks = [{"output_ids": [7], "meta_info": {}}, {"output_ids": [7, 8, 9], "meta_info": {}},
                      {"output_ids": [7, 8, 9, 10], "meta_info": {
                          "completion_tokens": 4, "spec_verify_ct": 2, "spec_accept_histogram": [1, 0, 1],
                          "finish_reason": {"type": "length", "length": 4}}}]
            text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"success": True, "message": "ok"})
    return httpx.MockTransport(handle)


def test_streaming_generate_and_draft_only_swap_over_http():
    calls = []
    client = httpx.Client(transport=fake_sglang(calls), base_url="http://sglang")
    backend = SGLangBackend(CFG, WordTokenizer(), FakeRegistry(), head_version="v1", fingerprint="fp", client=client)
    server = DecodeServer(backend)
    done = server.generate(DecodeRequest(request_id="r1", prompt="w1 w2 w3", max_tokens=4))
    assert done.text == "w7 w8 w9 w10" and done.finish_reason == "length"
    assert done.spec.accept_length == 2.0 and done.spec.verify_steps == 2 and done.spec.backend == "sglang"
    path, body = calls[0]
    assert path == "/generate" and body["input_ids"] == [1, 2, 3] and body["sampling_params"]["max_new_tokens"] == 4
    res = server.swap_head("v2")
    assert res.ok and backend.head_version == "v2"
    path, body = calls[-1]
    assert path == "/update_weights_from_disk" and body["model_path"] == "/registry/v2"
    assert "all" not in body.values() and body[CFG.weight_selector_field] == "draft"
    assert not server.swap_head("v9").ok and not server.swap_head("none").ok and backend.head_version == "v2"


def test_sglang_own_argument_parser_accepts_our_launch_args():
    pytest.importorskip("sglang", reason="sglang is the optional extra adaptive-eagle[sglang]; not installed here")
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(CFG.launch_args()[3:])
    assert args.speculative_algorithm == "EAGLE3" and args.speculative_draft_model_path == "/heads/v1"
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (4, 3, 12)
    assert args.enable_metrics
