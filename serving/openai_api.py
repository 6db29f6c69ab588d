"""The OpenAI-compatible surface: request bodies in, response and SSE chunk bodies out, errors.

Owns: parsing `/v1/chat/completions` and `/v1/completions` bodies into a `DecodeRequest` with clear
4xx errors (OpenAI error body naming the field and the allowed range; a body that is not JSON, nests too
deep or holds a lone UTF-16 surrogate is a 400 too), the response and chunk JSON, the `adaptive_eagle` extra
field. Must not touch: routing, replicas, auth (gateway.py).

Extras beyond the OpenAI API (documented for clients):
- request `metadata` keys: `capture` (false: never stored, never used to draft other requests),
  `tenant`, `domain` (a tag carried into the trace, e.g. code, math), `head` (serve this request
  with that head version: replicas serving it must exist);
- request `top_k` (0 = off);
- request `seed`: a signed 64-bit integer; a `temperature` below messages.MIN_TEMPERATURE decodes greedily and a
  `top_p` below messages.MIN_TOP_P keeps the top token alone (their limits; float32 logits hold no smaller ones);
- response field `adaptive_eagle` (top level of a response and of the final SSE chunk):
  head_version, accept_length (tokens per verify step, bonus included), verify_steps, draft_tokens,
  accepted_drafts, backend, replica, elapsed_s, tpot_s, tokens_per_s, captured, domain.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from adaptive_eagle.grammar import MAX_SCHEMA_BYTES
from serving import tools as T
from serving.messages import SEED_MAX, SEED_MIN, DecodeRequest, Finished

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "invalid_request_error", 405: "invalid_request_error", 409: "invalid_request_error",
               413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error"}
UNSUPPORTED = {"logprobs": "logprobs are not returned", "top_logprobs": "logprobs are not returned",
               "echo": "echo is not supported",
               "functions": "the legacy functions field is not supported (send tools)",
               "suffix": "suffix is not supported"}


_SURROGATE = re.compile("[\ud800-\udfff]")


def _printable(text: str) -> str:
    """`text` with lone UTF-16 surrogates escaped (`\\ud800`): an error body must encode as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class ApiError(Exception):
    """An error answered as an OpenAI error body. The message starts with `param`, the field at fault,
    when there is one (prefixed when it does not already)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: str = "invalid_request") -> None:
        param, message = None if param is None else _printable(param), _printable(message)
        message = message if param is None or message.startswith(param) else f"{param}: {message}"
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: Optional[int] = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    n: int = 1
    metadata: Optional[dict[str, Any]] = None
    user: Optional[str] = None

    @field_validator("seed")
    @classmethod
    def _seed_in_range(cls, seed: Optional[int]) -> Optional[int]:
        if seed is not None and not SEED_MIN <= seed <= SEED_MAX:
            raise PydanticCustomError("seed_range", "must be a signed 64-bit integer, in [{lo}, {hi}]; got {seed}",
                                      {"lo": SEED_MIN, "hi": SEED_MAX, "seed": seed})
        return seed


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Optional[Union[str, list[TextPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[T.ToolCall]] = None  # assistant: the calls it made
    tool_call_id: Optional[str] = None  # tool: the call this message answers


class ChatBody(_Body):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    tools: Optional[list[T.ToolDef]] = None
    tool_choice: Optional[T.ToolChoice] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[dict[str, Any]] = None
    _tools: Optional[T.ToolSpec] = PrivateAttr(None)  # checked by parse_chat; None: no tools given

    @property
    def tool_spec(self) -> Optional[T.ToolSpec]:
        return self._tools


class CompletionBody(_Body):
    prompt: Union[str, list[int], list[str]]


def parse_json(raw: bytes) -> dict:
    """A request body as a JSON object whose strings are all text (no lone surrogate), else a 400."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: nested too deeply", None, "invalid_json") from None
    except ValueError as e:  # malformed, not UTF-8/16/32, or an integer of more digits than Python converts
        raise ApiError(400, f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
    if (where := _lone_surrogate(body)) is not None:
        raise ApiError(400, f"{where}: holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its pair), "
                            "which is not text", where, "invalid_value")
    return body


def _lone_surrogate(body: dict) -> Optional[str]:
    """The path (`messages.0.content`) of a key or string in a decoded JSON body holding a lone UTF-16
    surrogate, else None. JSON lets `"\\ud800"` through; no tokenizer and no UTF-8 encoder takes it."""
    todo: list[tuple[str, Any]] = [("", body)]
    while todo:  # iterative: a body as deep as the JSON decoder allows must not overflow the stack here
        path, value = todo.pop()
        if isinstance(value, str) and _SURROGATE.search(value):
            return path
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            name = str(key) or '""'  # an empty key, named as JSON spells it
            where = f"{path}.{name}" if path else name
            if isinstance(key, str) and _SURROGATE.search(key):
                return where
            todo.append((where, item))
    return None


def validate_body(model: type[BaseModel], body: dict):
    """`body` as `model`, else a 400 naming the first field at fault (and its allowed range, if it has one)."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) or '""' for p in err["loc"]) or None
        allowed = _allowed_range(model, err["loc"])
        message = err["msg"] if allowed is None else f"{err['msg']} (allowed: {allowed})"
        raise ApiError(400, f"{param}: {message}" if param else message, param, "invalid_value") from None


def _allowed_range(model: type[BaseModel], loc: tuple) -> Optional[str]:
    """The numeric range of a top-level field with bounds, as an interval ("[0.0, 1.0]"), else None."""
    info = model.model_fields.get(loc[0]) if len(loc) == 1 else None
    if info is None:
        return None
    lo, hi = "(-inf", "inf)"
    for m in info.metadata:
        for name, fmt in (("ge", "[{}"), ("gt", "({}")):
            if getattr(m, name, None) is not None:
                lo = fmt.format(getattr(m, name))
        for name, fmt in (("le", "{}]"), ("lt", "{})")):
            if getattr(m, name, None) is not None:
                hi = fmt.format(getattr(m, name))
    return None if (lo, hi) == ("(-inf", "inf)") else f"{lo}, {hi}"


def _flag(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() not in ("false", "0", "no", "off", "")
    return bool(value)


def _check_ranges(b: _Body, max_tokens: Optional[int], limit: int) -> None:
    if not 0.0 <= b.temperature <= 2.0:
        raise ApiError(400, f"temperature must be in [0, 2], got {b.temperature}", "temperature", "invalid_value")
    if not 0.0 < b.top_p <= 1.0:
        raise ApiError(400, f"top_p must be in (0, 1], got {b.top_p}", "top_p", "invalid_value")
    if b.top_k < 0:
        raise ApiError(400, f"top_k must be >= 0 (0 = off), got {b.top_k}", "top_k", "invalid_value")
    if max_tokens is not None and not 1 <= max_tokens <= limit:
        raise ApiError(400, f"max_tokens must be in [1, {limit}], got {max_tokens}", "max_tokens", "invalid_value")
    if b.n != 1:
        raise ApiError(400, f"n must be 1 (one choice per request), got {b.n}", "n", "invalid_value")
    for name, why in UNSUPPORTED.items():
        if (b.model_extra or {}).get(name):
            raise ApiError(400, f"{name}: {why} by this server", name, "unsupported_parameter")


def _stops(stop) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(stops) > 4 or any(not s for s in stops):
        raise ApiError(400, "stop must be at most 4 non-empty strings", "stop", "invalid_value")
    return stops


def _decode_request(b: _Body, max_tokens: Optional[int], default_max_tokens: int, response_format=None,
                    **prompt) -> DecodeRequest:
    meta = b.metadata or {}
    tenant = str(meta.get("tenant") or b.user or "default")
    return DecodeRequest(
        request_id=f"req-{uuid.uuid4().hex[:24]}", temperature=b.temperature, top_p=b.top_p, top_k=b.top_k,
        max_tokens=max_tokens or default_max_tokens, seed=b.seed, stop=_stops(b.stop), tenant=tenant,
        domain=str(meta["domain"]) if meta.get("domain") else None, capture=_flag(meta.get("capture", True)),
        head=str(meta["head"]) if meta.get("head") else None, response_format=response_format, **prompt)


def parse_chat(body: dict, limit: int, default_max_tokens: int) -> tuple[ChatBody, DecodeRequest]:
    b = validate_body(ChatBody, body)
    max_tokens = b.max_completion_tokens if b.max_completion_tokens is not None else b.max_tokens
    _check_ranges(b, max_tokens, limit)
    if not b.messages:
        raise ApiError(400, "messages must hold at least one message", "messages", "invalid_value")
    try:
        T.check_history(b.messages)
        spec = T.check_tools(b.tools, b.tool_choice, b.parallel_tool_calls) if b.tools or b.tool_choice else None
    except T.ToolError as e:
        raise ApiError(400, e.message, e.param, "invalid_value") from None
    b._tools = spec if spec is not None and spec.tools else None
    fmt = response_format(b.response_format)
    if (call := T.call_format(b._tools)) is not None:
        if fmt is not None:
            raise ApiError(400, "a required or named tool call and a response_format cannot both constrain the "
                                "answer: drop one", "response_format", "invalid_value")
        fmt = json.dumps(call)
    msgs = []
    for i, m in enumerate(b.messages):
        text = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        if m.role == "tool" and not text:
            raise ApiError(400, "a tool message must carry the tool's result as content", f"messages.{i}.content",
                           "invalid_value")
        msgs.append(("system" if m.role == "developer" else m.role, text, m.tool_calls, m.tool_call_id))
    return b, _decode_request(b, max_tokens, default_max_tokens, messages=T.wire_messages(msgs), response_format=fmt,
                              tools=T.wire_tools(b._tools))


def response_format(rf: Optional[dict]) -> Optional[str]:
    """The request's response_format as the replica takes it (JSON text; None: free text), else a 400 naming the
    field: "text", "json_object" (any JSON object) or "json_schema" with a JSON Schema under 64 KiB."""
    from jsonschema import SchemaError, validators

    kind = (rf or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "json_object"})
    if kind != "json_schema":
        raise ApiError(400, f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                       "response_format.type", "invalid_value")
    body = rf.get("json_schema")
    if not isinstance(body, dict) or not isinstance(body.get("schema"), dict):
        raise ApiError(400, "must hold a JSON Schema object as json_schema.schema", "response_format.json_schema",
                       "invalid_value")
    text = json.dumps({"type": "json_schema", "json_schema": {"schema": body["schema"],
                                                               "strict": bool(body.get("strict"))}})
    if len(text) > MAX_SCHEMA_BYTES:
        raise ApiError(400, f"the schema is {len(text)} bytes of JSON; at most {MAX_SCHEMA_BYTES}",
                       "response_format.json_schema.schema", "invalid_value")
    try:
        validators.validator_for(body["schema"]).check_schema(body["schema"])
    except SchemaError as e:
        raise ApiError(400, f"not a valid JSON Schema: {e.message}", "response_format.json_schema.schema",
                       "invalid_value") from None
    except Exception as e:  # noqa: BLE001 - an odd $schema is bad input too
        raise ApiError(400, f"not a valid JSON Schema: {type(e).__name__}: {e}", "response_format.json_schema.schema",
                       "invalid_value") from None
    return text


def parse_completion(body: dict, limit: int, default_max_tokens: int) -> tuple[CompletionBody, DecodeRequest]:
    b = validate_body(CompletionBody, body)
    _check_ranges(b, b.max_tokens, limit)
    prompt = b.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        if len(prompt) != 1:
            raise ApiError(400, "one prompt per request (batched prompts are not supported)", "prompt",
                           "invalid_value")
        prompt = prompt[0]
    if not prompt or (isinstance(prompt, str) and not prompt.strip()):
        raise ApiError(400, "prompt must not be empty", "prompt", "invalid_value")
    return b, _decode_request(b, b.max_tokens, default_max_tokens,
                              prompt=prompt if isinstance(prompt, str) else tuple(prompt))


# ---- responses ---------------------------------------------------------------------------------
def usage(f: Finished) -> dict:
    return {"prompt_tokens": f.prompt_tokens, "completion_tokens": f.completion_tokens,
            "total_tokens": f.prompt_tokens + f.completion_tokens}


def chat_response(rid: str, model: str, f: Finished, tools: Optional[T.ToolSpec] = None) -> dict:
    """The chat completion; with active tools, the answer's tool calls parsed out (finish_reason "tool_calls")."""
    message: dict[str, Any] = {"role": "assistant", "content": f.text}
    reason = f.finish_reason
    if tools is not None and tools.active:
        content, calls = T.parse(f.text, tools)
        message["content"] = content
        if calls:
            message["tool_calls"], reason = calls, "tool_calls"
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": None}],
            "usage": usage(f), "adaptive_eagle": f.spec.to_json()}


def completion_response(rid: str, model: str, f: Finished) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": f.text, "finish_reason": f.finish_reason, "logprobs": None}],
            "usage": usage(f), "adaptive_eagle": f.spec.to_json()}


def chat_chunk(rid: str, model: str, delta: dict, finished: Optional[Finished] = None,
               finish_reason: Optional[str] = None) -> dict:
    reason = (finish_reason or finished.finish_reason) if finished else None
    out = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
           "choices": [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}]}
    if finished is not None:
        out["usage"], out["adaptive_eagle"] = usage(finished), finished.spec.to_json()
    return out


def tool_deltas(events: list, first_index: int) -> list[dict]:
    """Chat deltas for CallStream events, as OpenAI streams tool calls: text as content; a call as one delta
    with its index, id, type and name (empty arguments), then one with its arguments."""
    out, index = [], first_index
    for kind, value in events:
        if kind == "text":
            out.append({"content": value})
            continue
        fn = value["function"]
        out.append({"tool_calls": [{"index": index, "id": value["id"], "type": "function",
                                    "function": {"name": fn["name"], "arguments": ""}}]})
        out.append({"tool_calls": [{"index": index, "function": {"arguments": fn["arguments"]}}]})
        index += 1
    return out


def completion_chunk(rid: str, model: str, text: str, finished: Optional[Finished] = None) -> dict:
    out = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
           "choices": [{"index": 0, "text": text, "finish_reason": finished.finish_reason if finished else None,
                        "logprobs": None}]}
    if finished is not None:
        out["usage"], out["adaptive_eagle"] = usage(finished), finished.spec.to_json()
    return out


def sse(obj: dict) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"
