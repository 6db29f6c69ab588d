"""The SGLang backend against the SGLang 0.5.23 source, read with `ast` from the wheel (never imported):
every path it calls exists with its method, every request field and sampling parameter it sends is one the
request struct defines, every launch flag is a server argument, every meta_info / finish-reason / checksum
field it reads is one upstream writes, and its weight-update payload uses only globals upstream's allow-list
admits (read from its opcodes, never run: the project never unpickles).
Then the facts the design rests on (the disk update has no selector, the tensor update is a session, the
running worker keeps its launch vocabulary map, streams are cumulative unless asked) and the stand-in's own
field sets. Under `make test` the wheel is required (SGLANG_WHEEL is set): a missing wheel fails these tests.
"""

import ast
import base64
import json
import os
import pickletools
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from adaptive_eagle.grammar import tool_call_ebnf
from serving import tools
from serving.backend import RequestError
from serving.messages import DecodeRequest
from serving.sglang_backend import SGLangBackend, SGLangConfig, launch_sglang
from serving.sglang_protocol import (CHECKSUM_FIELDS, DRAFT, ENDPOINTS, FINISH_FIELDS, LEGACY_SPEC_FIELDS, META_FIELDS,
                                     TARGET, UPDATE_FIELDS, begin_update_body, checksum_body, end_update_body,
                                     finish_reason_of, generate_body, named_tensor_payload, tensor_update_bodies,
                                     warmup_body)
from tests.serving import sglang_standin as standin
from tests.serving.sglang_upstream import Upstream, _keys, wheel_path

REPO = Path(__file__).resolve().parents[2]
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                                        "maxLength": 12}},
                                                 "required": ["city"], "additionalProperties": False}}
CALC = {"name": "calc", "parameters": {"type": "object", "properties": {"x": {"type": "number"},
                                                                        "tags": {"type": "array",
                                                                                 "items": {"type": "string"}}}}}
CALL_FORMAT = tools.call_format(tools.check_tools([tools.ToolDef(type="function", function=f) for f in (WEATHER, CALC)],
                                                  "required", None))


@pytest.fixture(scope="module")
def upstream() -> Upstream:
    return Upstream(wheel_path())


def bodies() -> dict[str, list[dict]]:
    """Every body the protocol module builds, by endpoint name, with every optional field present."""
    req = DecodeRequest(request_id="r", prompt=(1, 2), temperature=0.7, top_p=0.9, top_k=5, seed=3, stop=("x",),
                        response_format='{"type": "json_object"}')
    call = DecodeRequest(request_id="c", prompt=(1, 2), response_format=json.dumps(CALL_FORMAT))
    tensors = {"fc.weight": torch.zeros(2, 2), "d2t": torch.zeros(2, dtype=torch.int64)}
    return {"generate": [generate_body(req, [1, 2]), generate_body(call, [1, 2]), warmup_body([1], "w")],
            "begin_update": [begin_update_body()],
            "tensor_update": tensor_update_bodies(tensors, "v2", tp_size=2, max_bytes=8),
            "end_update": [end_update_body()], "checksum": [checksum_body(DRAFT), checksum_body(TARGET)]}


def check_request(upstream: Upstream, method: str, path: str, body: dict) -> list[str]:
    """What in one request 0.5.23 does not define (empty: all of it exists)."""
    if method not in upstream.routes.get(path, ()):
        return [f"{method} {path}: no such route (methods there: {sorted(upstream.routes.get(path, ()))})"]
    ep = next(e for e in ENDPOINTS.values() if e.path == path)
    if ep.request_struct is None:
        return [f"{path} takes no body, got {sorted(body)}"] if body else []
    fields = upstream.struct_fields(ep.request_struct)
    problems = [f"{path}: {ep.request_struct} has no field {k!r}" for k in body if k not in fields]
    if "selector" in body and body["selector"] not in upstream.literal_choices(ep.request_struct, "selector"):
        problems.append(f"{path}: selector {body['selector']!r} is not one of its Literal values")
    for k in (body.get("sampling_params") or {}):
        if k not in upstream.api_sampling_fields:
            problems.append(f"{path}: sampling_params has no field {k!r} (the JSON contract rejects it)")
    return problems


# ---- what the backend sends -----------------------------------------------------------------------------
def test_every_endpoint_exists_with_its_method_and_request_struct(upstream):
    for name, ep in ENDPOINTS.items():
        assert ep.method in upstream.routes.get(ep.path, ()), f"{name}: {ep.method} {ep.path}"
        if ep.request_struct is not None:
            assert upstream.struct_fields(ep.request_struct), ep.request_struct


def test_every_request_body_field_exists_upstream(upstream):
    for name, built in bodies().items():
        ep = ENDPOINTS[name]
        for body in built:
            assert check_request(upstream, ep.method, ep.path, body) == []


def test_the_contract_check_catches_a_field_or_path_upstream_does_not_define(upstream):
    assert check_request(upstream, "POST", "/update_weights_from_tensor", {"serialized_named_tensors": [],
                                                                          "target": "draft"})
    assert check_request(upstream, "POST", "/generate", {"input_ids": [1], "sampling_params": {"seed": 1}})
    assert check_request(upstream, "POST", "/update_weights_from_disk_draft", {})
    assert check_request(upstream, "POST", "/begin_weight_update", {"selector": "drafts"})


def test_every_launch_flag_is_a_server_argument_with_the_right_arity(upstream):
    cfg = SGLangConfig(model_path="/m", draft_model_path="/h", tp_size=2)
    args = cfg.launch_args("python")[3:]
    i = 0
    while i < len(args):
        flag = args[i]
        arg = upstream.server_args.get(flag)
        assert arg is not None, f"{flag} is not a 0.5.23 server argument"
        takes_value = not arg.is_bool
        assert takes_value == (i + 1 < len(args) and not args[i + 1].startswith("--")), flag
        i += 2 if takes_value else 1


def test_what_the_backend_reads_is_what_upstream_writes(upstream):
    written = upstream.meta_info_keys
    assert set(META_FIELDS) <= written, set(META_FIELDS) - written
    assert {"output_ids", "meta_info", "text"} <= written  # a streamed chunk
    legacy = {name for names in LEGACY_SPEC_FIELDS.values() for name in names}
    assert not legacy & written, "0.5.23 writes only the canonical spec_* names; the legacy ones serve older servers"
    assert set(upstream.finish_reasons) == {"stop", "length", "abort"}
    assert set(FINISH_FIELDS) <= upstream.finish_reasons["abort"]
    error_chunk = _keys(upstream.function("srt/entrypoints/http_server.py", "serve_generate_request"))
    assert {"error", "message", "code"} <= error_chunk
    assert set(CHECKSUM_FIELDS) <= _keys(upstream.handler("/weights_checker"))
    for path in ("/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"):
        assert set(UPDATE_FIELDS) <= _keys(upstream.handler(path)), path


def read_payload(data: bytes) -> tuple[list, list, list]:
    """What a pickle would do, read from its opcodes without running any (pickletools.genops): the globals it
    would import, the strings it pushes, and the bytes objects it carries (here: each tensor's storage)."""
    imported, strings, blobs, pushed, memo = [], [], [], [], {}
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"):
            strings.append(arg)
            pushed.append(arg)
        elif op.name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif op.name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[arg] = pushed[-1] if pushed else None
        elif op.name in ("BINGET", "LONG_BINGET", "GET"):
            pushed.append(memo.get(arg))
        elif op.name == "STACK_GLOBAL":
            imported.append((pushed[-2], pushed[-1]))
            pushed.append(None)
        elif op.name == "GLOBAL":
            imported.append(tuple(arg.split(" ", 1)))
            pushed.append(None)
        elif op.name in ("SHORT_BINBYTES", "BINBYTES", "BINBYTES8"):
            blobs.append(arg)
            pushed.append(None)
        elif op.name not in ("PROTO", "FRAME", "MARK", "STOP"):
            pushed.append(None)
    return imported, strings, blobs


def test_the_weight_update_payload_uses_only_globals_upstreams_allow_list_admits(upstream):
    tensors = {"midlayer.self_attn.q_proj.weight": torch.randn(3, 4).to(torch.bfloat16),
               "d2t": torch.arange(5), "t2d": torch.ones(7, dtype=torch.bool)}
    data = base64.b64decode(named_tensor_payload(tensors))
    assert data[:2] == b"\x80\x04"  # upstream takes bytes that start like this as a pickle, not base64
    imported, strings, blobs = read_payload(data)
    assert set(imported) <= upstream.unpickle_allowed | upstream.unpickle_redirected, set(imported)
    assert standin.REDIRECTED in imported and standin.REDIRECTED in upstream.unpickle_redirected
    assert standin.ALLOWED_GLOBALS <= upstream.unpickle_allowed
    assert [s for s in strings if s in tensors] == list(tensors)  # every name, in order
    # each tensor travels by value: the bytes the redirected load reads (torch's legacy serialisation of one
    # storage) end with the element count and the storage's raw bytes
    assert len(blobs) == len(tensors)
    for blob, t in zip(blobs, tensors.values()):
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        assert blob.endswith(t.numel().to_bytes(8, "little") + raw), t.dtype


def test_no_draft_swap_goes_through_the_disk_update():
    """/update_weights_from_disk has no selector (next test) and loads into the target first."""
    hits = [p for p in (*REPO.glob("serving/*.py"), *REPO.glob("ops/*.py"), *REPO.glob("ops/*.sh"))
            if "update_weights_from_disk" in p.read_text()]
    assert hits == []


# ---- the facts the design rests on -------------------------------------------------------------------------
def test_the_disk_update_has_no_selector_and_the_session_endpoints_do(upstream):
    assert "selector" not in upstream.struct_fields("UpdateWeightFromDiskReqInput")
    for struct in ("BeginWeightUpdateReqInput", "UpdateWeightsFromTensorReqInput", "CheckWeightsReqInput"):
        assert upstream.literal_choices(struct, "selector") == {"target", "draft", "all"}, struct
    disk = upstream.function("srt/managers/scheduler_components/weight_updater.py", "update_weights_from_disk")
    assert "self._select_runners()" in __import__("ast").unparse(disk)  # every runner, the target first


def test_a_tensor_update_outside_a_session_is_refused_upstream(upstream):
    import ast

    fn = ast.unparse(upstream.function("srt/managers/scheduler_components/weight_updater.py",
                                       "update_weights_from_tensor"))
    assert "self._session is None" in fn and "must run between" in fn


def test_the_running_worker_keeps_the_vocabulary_map_it_started_with(upstream):
    import ast

    load = ast.unparse(upstream.function("srt/models/llama_eagle3.py", "load_weights"))
    assert "self.hot_token_id = loaded_weight" in load  # a d2t update lands on the model ...
    init = ast.unparse(upstream.function("srt/speculative/eagle_worker_v2.py", "init_lm_head"))
    assert "self.hot_token_id = self.draft_runner.model.hot_token_id.to(" in init  # ... the worker copied it at start


def test_a_d2t_in_a_draft_update_kills_the_server_upstream_so_it_is_never_sent(upstream):
    """Why serving.sglang_swap.NOT_SENT holds d2t, and why the stand-in dies on one: the runner moves each
    tensor to the GPU, the EAGLE-3 loader adds a CPU arange to d2t, nothing on the way catches the error, and
    a scheduler that raises signals its parent to quit."""
    import ast

    from serving.sglang_swap import NOT_SENT, VOCAB_MAP

    runner = "srt/model_executor/model_runner_components/weight_updater.py"
    assert "return tensor.to(device)" in ast.unparse(upstream.function(runner, "_unwrap_tensor"))
    update = upstream.function(runner, "update_weights_from_tensor")
    assert "_unwrap_tensor(tensor" in ast.unparse(update) and "load_weights(named_tensors)" in ast.unparse(update)
    assert not any(isinstance(n, ast.Try) for n in ast.walk(update))  # from_disk has one; this path has none
    scheduler = upstream.function("srt/managers/scheduler_components/weight_updater.py", "update_weights_from_tensor")
    assert not any(isinstance(n, ast.Try) for n in ast.walk(scheduler))
    load = ast.unparse(upstream.function("srt/models/llama_eagle3.py", "load_weights"))
    assert "loaded_weight + torch.arange(loaded_weight.shape[0])" in load  # no device= : a CPU arange
    assert "signal.SIGQUIT" in upstream.source("srt/managers/scheduler.py")
    assert VOCAB_MAP in NOT_SENT and "t2d" in NOT_SENT


def test_eagle3_servers_run_48_requests_at_once_unless_told_otherwise(upstream):
    """The SGLang replica's default max_inflight: what SGLang itself runs for EAGLE-3 (speculative_hook)."""
    import ast

    from serving.sglang_backend import EAGLE_MAX_RUNNING_REQUESTS

    hook = ast.unparse(upstream.function("srt/arg_groups/speculative_hook.py", "_handle_eagle_family"))
    assert "cfg.max_running_requests is None" in hook
    assert f"max_running_requests={EAGLE_MAX_RUNNING_REQUESTS}" in hook
    assert "--max-running-requests" in {f for a in upstream.server_args.values() for f in a.flags}
    assert standin.EAGLE_MAX_RUNNING_REQUESTS == EAGLE_MAX_RUNNING_REQUESTS


def test_streams_are_cumulative_unless_the_server_is_told_otherwise(upstream):
    assert upstream.field_default("incremental_streaming_output") is False
    assert upstream.field_default("weight_version") == "default"
    assert "--incremental-streaming-output" in SGLangConfig(model_path="m", draft_model_path="h").launch_args()


def test_the_stand_in_implements_only_what_upstream_defines(upstream):
    for path, fields in standin.FIELDS.items():
        ep = next(e for e in ENDPOINTS.values() if e.path == path)
        assert fields <= set(upstream.struct_fields(ep.request_struct)), path
    assert standin.SAMPLING_FIELDS <= set(upstream.api_sampling_fields)


def _launched(tmp_path):
    """A stand-in SGLang server launched as the backend launches one, serving head v1: (host, client, backend)."""
    registry = standin.make_registry(tmp_path / "registry")
    host = standin.StandInHost()
    cfg = SGLangConfig(model_path="/m", draft_model_path=str(registry.get("v1")), weight_version="v1", launch=True,
                       health_poll_s=0.001, startup_timeout_s=5.0)
    client = host.client()
    backend = SGLangBackend(cfg, standin.WordTokenizer(), registry, "v1", client=client,
                            process=launch_sglang(cfg, client=client, spawn=host.spawn), spawn=host.spawn)
    return host, client, backend


def test_everything_the_backend_sends_on_its_whole_path_exists_upstream(upstream, tmp_path):
    """Generate, a swap in place, a swap by restart, a rollback: every request the stand-in saw."""
    host, client, backend = _launched(tmp_path)
    req = DecodeRequest(request_id="r", prompt="w5 w6", max_tokens=6, temperature=0.5, top_k=3, seed=1, stop=("w9",))
    for version in ("v2", "v3", "v1"):
        list(backend.stream(req, backend.prepare(req), capture=True))
        assert backend.swap_head(version).ok
    assert {p for _, p, _ in host.log} >= {"/generate", "/begin_weight_update", "/update_weights_from_tensor",
                                           "/end_weight_update", "/weights_checker", "/health"}
    problems = [p for method, path, body in host.log for p in check_request(upstream, method, path, body)]
    assert problems == []
    for args in host.launches:
        assert all(a in upstream.server_args for a in args[3:] if a.startswith("--")), args


def test_the_stand_in_refuses_what_upstream_refuses(tmp_path):
    registry = standin.make_registry(tmp_path / "registry")
    host = standin.StandInHost()
    host.spawn(SGLangConfig(model_path="/m", draft_model_path=str(registry.get("v1"))).launch_args())
    client = host.client()
    tensors = tensor_update_bodies({"lm_head.weight": torch.zeros(40, 32)}, "v2", 1, 1 << 20)[0]
    r = client.post("/update_weights_from_tensor", json=tensors)
    assert r.status_code == 400 and "must run between" in r.json()["message"]
    assert client.post("/end_weight_update", json={}).json()["success"] is False
    assert client.post("/begin_weight_update", json={"selector": "draft", "target": "x"}).status_code == 422
    assert client.post("/begin_weight_update", json={"selector": "target"}).json()["success"]
    r = client.post("/update_weights_from_tensor", json=dict(tensors, selector="target"))  # a draft head, to the target
    assert r.status_code == 400 and "target parameter lm_head.weight" in r.json()["message"]
    assert client.post("/end_weight_update", json={}).json()["success"]
    r = client.post("/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "seed": 1}})
    assert r.status_code == 400 and "seed" in r.json()["error"]


def _call(name: str, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


ONE = _call("get_weather", {"city": "Paris"})
CALL_TEXTS = {  # text -> whether a required call (parallel: up to tools.PARALLEL_CALLS) may be it
    ONE: True, ONE + "\n" + _call("calc", {"x": 2.5, "tags": ["a"]}): True,
    "\n".join([ONE] * tools.PARALLEL_CALLS): True, "\n".join([ONE] * (tools.PARALLEL_CALLS + 1)): False,
    ONE + "\n": False, "Sure. " + ONE: False, _call("get_weather", {"city": "Parisssssssss"}): False,
    _call("get_weather", {"city": "Paris", "units": "C"}): False, _call("get_time", {}): False,
    ONE.replace(": ", ":"): False,  # one whitespace layout
}
ACCEPTS = """
import json, sys, xgrammar
from xgrammar.testing import _is_grammar_accept_string
grammar = xgrammar.Grammar.from_ebnf(open(sys.argv[1]).read())
print(json.dumps({"where": xgrammar.__file__,
                  "accepts": [_is_grammar_accept_string(grammar, t) for t in json.load(open(sys.argv[2]))]}))
"""


def _accepts(ebnf: str, tmp: Path, pythonpath: str | None) -> dict:
    (tmp / "g.ebnf").write_text(ebnf)
    (tmp / "texts.json").write_text(json.dumps(list(CALL_TEXTS)))
    env = dict(os.environ, PYTHONPATH=pythonpath) if pythonpath else dict(os.environ)
    run = subprocess.run([sys.executable, "-c", ACCEPTS, str(tmp / "g.ebnf"), str(tmp / "texts.json")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout)


def test_sglangs_own_xgrammar_reads_a_required_calls_ebnf_as_the_reference_engine_does(upstream, tmp_path):
    """A required or named tool_choice reaches SGLang replicas as `ebnf` (the grammar the reference engine
    compiles, as text). SGLang's xgrammar backend compiles that text with compile_grammar; here the xgrammar
    version the wheel pins (its own wheel, unpacked, never installed) reads the same text and accepts exactly
    the calls the engine's xgrammar accepts, and what the format promises."""
    assert "compile_grammar(key_string)" in ast.unparse(upstream.function(
        "srt/constrained/xgrammar_backend.py", "dispatch_ebnf"))
    pin = upstream.pinned("xgrammar")
    found = sorted(upstream.wheel.parent.glob(f"xgrammar-{pin}-*.whl"))
    assert found, f"no xgrammar-{pin} wheel beside the SGLang wheel: `make sglang-wheel` downloads it"
    zipfile.ZipFile(found[0]).extractall(tmp_path / "site")
    ebnf = tool_call_ebnf(CALL_FORMAT)
    theirs, ours = _accepts(ebnf, tmp_path, str(tmp_path / "site")), _accepts(ebnf, tmp_path, None)
    assert theirs["where"].startswith(str(tmp_path / "site")) and not ours["where"].startswith(str(tmp_path))
    assert theirs["accepts"] == ours["accepts"] == list(CALL_TEXTS.values())


def test_a_required_call_reaches_sglang_as_ebnf_and_a_grammar_sglang_cannot_compile_is_a_400(tmp_path):
    host, client, backend = _launched(tmp_path)
    req = DecodeRequest(request_id="r", prompt="w5 w6", max_tokens=4, response_format=json.dumps(CALL_FORMAT))
    list(backend.stream(req, backend.prepare(req), capture=False))
    sent = host.log[-1][2]["sampling_params"]
    assert sent["ebnf"] == tool_call_ebnf(CALL_FORMAT) and "json_schema" not in sent
    host.server.log.clear()
    r = client.post("/generate", json={"input_ids": [1], "stream": False,
                                       "sampling_params": {"max_new_tokens": 2, "ebnf": 'root ::= "a'}})
    assert r.json()["meta_info"]["finish_reason"]["status_code"] == 400
    with pytest.raises(RequestError):
        finish_reason_of(r.json()["meta_info"])
    r = client.post("/generate", json={"input_ids": [1], "sampling_params": {"ebnf": 'root ::= "a"',
                                                                              "json_schema": "{}"}})
    assert r.status_code == 400 and "Only one of" in r.json()["error"]
