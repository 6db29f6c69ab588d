"""The HTTP protocol of SGLang 0.5.23 as this project speaks it: what is sent, what an answer means.

Owns: `ENDPOINTS` (every path this project calls, its method and the upstream request struct that
parses its body; tests/serving/test_sglang_contract.py reads those structs' fields from the 0.5.23
wheel), the request bodies (`generate_body`, `begin_update_body`, `tensor_update_bodies`,
`end_update_body`, `checksum_body`), reading a response (`finish_reason_of`, `served_version`,
`verify_steps_from_meta`, `engine_checksum`), assembling a stream (`StreamAssembler`) and the
named-tensor payload of a weight update (`named_tensor_payload`). Must not touch: HTTP clients,
processes, the registry, threads (sglang_backend.py); sglang's package, which is never imported.

Facts from the 0.5.23 source this module relies on (each one checked by the contract tests):
- A streamed /generate chunk is `{"text", "output_ids", "meta_info"}`; `meta_info.completion_tokens`
  counts every output token so far; `output_ids` holds the new tokens with
  `--incremental-streaming-output` and all of them without it (the default). A chunk that failed is
  `{"error": {"message", "code", ...}}`; the stream ends with `data: [DONE]`.
- `meta_info.finish_reason` is null until the last chunk, then `{"type": "stop" | "length" | "abort",
  ...}`; an abort carries `message` and, when SGLang refused the request, `status_code`.
- Per-request acceptance is written once, on the finished chunk, under canonical names only:
  `spec_verify_ct`, `spec_accept_length` (completion tokens / verify steps), `spec_accept_rate`,
  `spec_num_correct_drafts`, `spec_num_proposed_drafts` (verify steps x (num_draft_tokens - 1)),
  `spec_correct_drafts_histogram` (entry k = verify steps that accepted k drafts). The names older
  servers wrote (`LEGACY_SPEC_FIELDS`) are read only when the canonical ones are missing.
- `meta_info.weight_version` is the server's label (`--weight-version`, "default" without it; a weight
  update with `weight_version` sets it); `weight_versions` lists spans when a request straddled one.
- Unknown keys in request bodies are ignored silently upstream (except inside `sampling_params`),
  so a misspelled field is a no-op there: the stand-in in the tests refuses them instead.
- `sampling_params` takes one constraint of `json_schema`, `regex`, `ebnf`, `structural_tag`; SGLang's
  xgrammar backend compiles `ebnf` text with `GrammarCompiler.compile_grammar` (xgrammar 0.2.7 pinned by
  the wheel) and aborts a request whose grammar does not compile with status 400. Response formats go as
  `json_schema`; a required or named tool_choice goes as the EBNF of the very grammar the reference engine
  compiles (adaptive_eagle/grammar.py `tool_call_ebnf`), so both replica kinds constrain to one language.
- `/update_weights_from_tensor` takes `serialized_named_tensors`, one base64 string per tensor-parallel
  rank; each is a pickle that SGLang reads with an allow-list of globals. This module only writes one
  (`named_tensor_payload`: CPU tensors by value, through globals that list admits, so the caller needs no
  shared memory or CUDA IPC with the server); nothing in the project reads one back.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
from dataclasses import dataclass
from typing import Optional

from adaptive_eagle.grammar import GrammarError, tool_call_ebnf
from adaptive_eagle.trace import VerifyStep
from serving.backend import RequestError
from serving.messages import DecodeRequest


@dataclass(frozen=True)
class Endpoint:
    path: str
    method: str
    request_struct: Optional[str]  # the 0.5.23 class that parses the body (io_struct / api_types); None: no body


ENDPOINTS = {
    "health": Endpoint("/health", "GET", None),
    "generate": Endpoint("/generate", "POST", "GenerateReqInput"),
    "begin_update": Endpoint("/begin_weight_update", "POST", "BeginWeightUpdateReqInput"),
    "tensor_update": Endpoint("/update_weights_from_tensor", "POST", "UpdateWeightsFromTensorReqInput"),
    "end_update": Endpoint("/end_weight_update", "POST", "EndWeightUpdateReqInput"),
    "checksum": Endpoint("/weights_checker", "POST", "CheckWeightsReqInput"),
}
DRAFT, TARGET = "draft", "target"  # the weight-update selectors this project uses ("all" never)
DEFAULT_VERSION = "default"  # meta_info.weight_version of a server launched without --weight-version

SPEC_FIELDS = ("spec_verify_ct", "spec_accept_length", "spec_accept_rate", "spec_num_correct_drafts",
               "spec_num_proposed_drafts", "spec_correct_drafts_histogram")
LEGACY_SPEC_FIELDS = {"spec_num_correct_drafts": ("spec_accepted_drafts", "spec_accept_token_num"),
                      "spec_num_proposed_drafts": ("spec_proposed_drafts", "spec_draft_token_num"),
                      "spec_correct_drafts_histogram": ("spec_accept_histogram",)}
META_FIELDS = ("completion_tokens", "finish_reason", "weight_version", "weight_versions", *SPEC_FIELDS)
FINISH_FIELDS = ("type", "message", "status_code")  # inside meta_info.finish_reason
CHECKSUM_FIELDS = ("success", "message", "per_engine_checksum")  # the /weights_checker answer
UPDATE_FIELDS = ("success", "message")  # the answer of the three weight-update endpoints


class SGLangError(RuntimeError):
    """SGLang did not finish a request or an operation (an abort, a broken stream, a server that stopped):
    the replica counts the request as failed and the client gets an error, never a truncated answer."""


class SGLangAborted(SGLangError):
    """SGLang aborted the request (finish_reason type "abort") for a reason of its own."""


class SGLangProtocolError(SGLangError):
    """An answer this module cannot read as the 0.5.23 protocol says it should look."""


# ---- /generate ------------------------------------------------------------------------------------
def json_schema_of(response_format: dict) -> dict:
    """The JSON schema an OpenAI response_format asks for (json_object: any object), as SamplingParams.json_schema
    takes it."""
    if response_format.get("type") == "json_object":
        return {"type": "object"}
    return (response_format.get("json_schema") or {}).get("schema") or {}


def generate_body(request: DecodeRequest, prompt_ids: list[int]) -> dict:
    """A streamed /generate for `request`. Fields: GenerateReqInput; sampling_params: SamplingParams."""
    sp = {"temperature": request.temperature, "top_p": request.top_p, "max_new_tokens": request.max_tokens}
    if request.top_k:
        sp["top_k"] = request.top_k
    if request.seed is not None:
        sp["sampling_seed"] = request.seed
    if request.stop:
        sp["stop"] = list(request.stop)  # SGLang stops there; the replica still cuts the text itself
    if request.response_format is not None:  # SGLang's own grammar backend constrains it (xgrammar by default)
        fmt = json.loads(request.response_format)
        if fmt.get("type") == "tool_call":  # the hermes calls' grammar the reference engine compiles, as EBNF
            try:
                sp["ebnf"] = tool_call_ebnf(fmt)
            except GrammarError as e:
                raise RequestError(f"tools: {e}", "tools") from None
        else:
            sp["json_schema"] = json.dumps(json_schema_of(fmt))
    return {"rid": request.request_id, "input_ids": list(prompt_ids), "sampling_params": sp, "stream": True}


def warmup_body(prompt_ids: list[int], rid: str) -> dict:
    """A short greedy non-streamed /generate: a restarted server has to answer it before it serves again."""
    return {"rid": rid, "input_ids": list(prompt_ids), "sampling_params": {"temperature": 0.0, "max_new_tokens": 4},
            "stream": False}


def finish_reason_of(meta: dict) -> Optional[str]:
    """"stop" or "length" once the request finished, None before. Raises RequestError for an abort SGLang
    answered with a 4xx status (it refused the request), SGLangAborted for any other abort, and
    SGLangProtocolError for a finish reason 0.5.23 never writes."""
    fr = meta.get("finish_reason")
    if fr is None:
        return None
    kind = fr.get("type") if isinstance(fr, dict) else fr
    if kind in ("stop", "length"):
        return kind
    if kind == "abort":
        detail = fr if isinstance(fr, dict) else {}
        message, status = detail.get("message") or "no reason given", detail.get("status_code")
        if isinstance(status, int) and 400 <= status < 500:
            raise RequestError(f"sglang refused the request: {message}", status=status)
        raise SGLangAborted(f"sglang aborted the request: {message}")
    raise SGLangProtocolError(f"meta_info.finish_reason has type {kind!r}; 0.5.23 writes stop, length or abort")


def error_of(chunk: dict) -> Exception:
    """The exception for a streamed `{"error": {...}}` chunk (a 4xx code: the request was refused)."""
    err = chunk.get("error") or {}
    message, code = str(err.get("message", err)), err.get("code")
    if isinstance(code, int) and 400 <= code < 500:
        return RequestError(f"sglang refused the request: {message}", status=code)
    return SGLangError(f"sglang failed the request: {message}")


class StreamAssembler:
    """The output tokens of one streamed /generate. Whether `output_ids` is incremental or cumulative is
    decided from what the server says, once per stream: `meta_info.completion_tokens` counts the tokens so
    far, so a chunk is incremental when the tokens held plus its ids make that count, cumulative when its
    ids alone do and begin with the tokens held. The two agree until some tokens are held, which is where
    the mode is fixed; any later chunk that does not fit it raises SGLangProtocolError instead of losing
    or repeating tokens."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.mode: Optional[str] = None  # "incremental" | "cumulative" once decided

    def push(self, output_ids, meta: dict) -> list[int]:
        """The new tokens of one chunk."""
        ids = [int(t) for t in (output_ids or ())]
        total = meta.get("completion_tokens")
        if not isinstance(total, int):
            raise SGLangProtocolError(f"a streamed chunk without meta_info.completion_tokens (got {total!r})")
        have = len(self.tokens)
        incremental = have + len(ids) == total
        cumulative = len(ids) == total and ids[:have] == self.tokens
        if self.mode is None and have and incremental != cumulative:
            self.mode = "incremental" if incremental else "cumulative"
        fits = {None: incremental or cumulative, "incremental": incremental, "cumulative": cumulative}[self.mode]
        if not fits:
            raise SGLangProtocolError(f"a streamed chunk of {len(ids)} ids with completion_tokens {total} after "
                                      f"{have} tokens fits no {self.mode or 'streaming'} mode")
        new = ids[have:] if self.mode == "cumulative" else ids
        self.tokens.extend(new)
        return new


# ---- meta_info: acceptance and version ------------------------------------------------------------
def _first(meta: dict, name: str):
    for key in (name, *LEGACY_SPEC_FIELDS.get(name, ())):
        if meta.get(key) is not None:
            return meta[key]
    return None


def verify_steps_from_meta(meta: dict, draft_tokens: int) -> tuple[VerifyStep, ...]:
    """Per-verify-step records from a finished response's meta_info. Exact with the correct-drafts histogram
    (entry k = steps that accepted k drafts) when it agrees with spec_verify_ct; otherwise the correct drafts
    are spread evenly over the steps (their sum and mean stay exact). `draft_tokens`: drafts verified per step
    when the answer does not say (num_draft_tokens - 1: the tree's root is the last committed token)."""
    completion = int(meta.get("completion_tokens") or 0)
    verify = _first(meta, "spec_verify_ct")
    if not verify:  # not speculative, or nothing decoded: one token per step
        return tuple(VerifyStep(0, 0, 0) for _ in range(completion))
    verify = int(verify)
    proposed = _first(meta, "spec_num_proposed_drafts")
    size = max(1, round(int(proposed) / verify)) if proposed else max(1, draft_tokens)
    hist = _first(meta, "spec_correct_drafts_histogram")
    counts = [k for k, n in enumerate(hist) for _ in range(int(n))] if hist else []
    if len(counts) != verify:
        correct = _first(meta, "spec_num_correct_drafts")
        if correct is None:
            length = meta.get("spec_accept_length")
            correct = round(float(length) * verify) - verify if length is not None else completion - verify
        correct = max(0, int(correct))
        counts = [correct // verify + (i < correct % verify) for i in range(verify)]
    return tuple(VerifyStep(max(size, k), k, k) for k in counts)


def served_version(meta: dict, assumed: str) -> tuple[str, bool]:
    """(the head version that served a finished request, whether it straddled a weight update). The label
    comes from meta_info.weight_version; `assumed` is used only for a server that has none ("default")."""
    spans = meta.get("weight_versions") or []
    straddled = len({s.get("version") for s in spans if isinstance(s, dict)}) > 1
    label = meta.get("weight_version")
    return (assumed if label in (None, DEFAULT_VERSION) else str(label)), straddled


# ---- weight updates ---------------------------------------------------------------------------------
def begin_update_body() -> dict:
    return {"selector": DRAFT}


def end_update_body() -> dict:
    return {}


def checksum_body(selector: str) -> dict:
    if selector not in (DRAFT, TARGET):
        raise ValueError(f"selector must be {DRAFT!r} or {TARGET!r}, got {selector!r}")
    return {"action": "checksum", "selector": selector}


def named_tensor_payload(tensors: dict) -> str:
    """One base64 string of a standard pickle (protocol 4) of [(name, tensor), ...]: CPU tensors by value.
    SGLang 0.5.23's allow-list admits the three globals it uses (torch._utils._rebuild_tensor_v2,
    collections.OrderedDict, and torch.storage._load_from_bytes, which it redirects to a weights-only load)."""
    named = [(name, t.detach().to("cpu").contiguous().clone()) for name, t in tensors.items()]
    buf = io.BytesIO()
    pickle.Pickler(buf, protocol=4).dump(named)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def tensor_update_bodies(tensors: dict, version: str, tp_size: int, max_bytes: int) -> list[dict]:
    """The /update_weights_from_tensor bodies that load `tensors` into the draft: groups of at most `max_bytes`
    (a tensor larger than that goes alone), each payload repeated for every tensor-parallel rank (rank i reads
    entry i). Only the last body sets `weight_version` and flushes the cache, so the label changes when the
    whole head is in and prefixes cached with the old head's draft states are dropped once."""
    groups: list[dict] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += nbytes
    bodies = []
    for i, group in enumerate(groups):
        last = i == len(groups) - 1
        body = {"serialized_named_tensors": [named_tensor_payload(group)] * tp_size, "selector": DRAFT,
                "flush_cache": last}
        if last:
            body["weight_version"] = version
        bodies.append(body)
    return bodies


def engine_checksum(answer: dict, selector: str) -> str:
    """per_engine_checksum of a /weights_checker answer; SGLangProtocolError when it reports none."""
    if not answer.get("success"):
        raise SGLangError(f"sglang could not checksum the {selector} weights: {answer.get('message', answer)}")
    digest = answer.get("per_engine_checksum")
    if not isinstance(digest, str) or not digest:
        raise SGLangProtocolError(f"the /weights_checker answer for {selector} has no per_engine_checksum")
    return digest
