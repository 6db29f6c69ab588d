"""The OpenAI-compatible surface: request bodies in, response and SSE chunk bodies out, errors.

Owns: parsing `/v1/chat/completions` and `/v1/completions` bodies into a `DecodeRequest` with clear
4xx errors (OpenAI error body naming the field and the allowed range), the response and chunk JSON,
the `adaptive_eagle` extra field. Must not touch: routing, replicas, auth (gateway.py).

Extras beyond the OpenAI API (documented for clients):
- request `metadata` keys: `capture` (false: never stored, never used to draft other requests),
  `tenant`, `domain` (a tag carried into the trace, e.g. code, math), `head` (serve this request
  with that head version: replicas serving it must exist);
- request `top_k` (0 = off);
- response field `adaptive_eagle` (top level of a response and of the final SSE chunk):
  head_version, accept_length (tokens per verify step, bonus included), verify_steps, draft_tokens,
  accepted_drafts, backend, replica, elapsed_s, tpot_s, tokens_per_s, captured, domain.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from serving.messages import DecodeRequest, Finished

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error"}
UNSUPPORTED = {"logprobs": "logprobs are not returned", "top_logprobs": "logprobs are not returned",
               "echo": "echo is not supported", "tools": "tool calls are not supported",
               "functions": "function calls are not supported", "suffix": "suffix is not supported"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: str = "invalid_request") -> None:
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


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: Optional[Union[str, list[TextPart]]] = None


class ChatBody(_Body):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None


class CompletionBody(_Body):
    prompt: Union[str, list[int], list[str]]


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
    return body


def validate_body(model: type[BaseModel], body: dict):
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise ApiError(400, f"{param}: {err['msg']}" if param else err["msg"], param, "invalid_value") from None


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


def _decode_request(b: _Body, max_tokens: Optional[int], default_max_tokens: int, **prompt) -> DecodeRequest:
    meta = b.metadata or {}
    tenant = str(meta.get("tenant") or b.user or "default")
    return DecodeRequest(
        request_id=f"req-{uuid.uuid4().hex[:24]}", temperature=b.temperature, top_p=b.top_p, top_k=b.top_k,
        max_tokens=max_tokens or default_max_tokens, seed=b.seed, stop=_stops(b.stop), tenant=tenant,
        domain=str(meta["domain"]) if meta.get("domain") else None, capture=_flag(meta.get("capture", True)),
        head=str(meta["head"]) if meta.get("head") else None, **prompt)


def parse_chat(body: dict, limit: int, default_max_tokens: int) -> tuple[ChatBody, DecodeRequest]:
    b = validate_body(ChatBody, body)
    max_tokens = b.max_completion_tokens if b.max_completion_tokens is not None else b.max_tokens
    _check_ranges(b, max_tokens, limit)
    if not b.messages:
        raise ApiError(400, "messages must hold at least one message", "messages", "invalid_value")
    msgs = []
    for m in b.messages:
        text = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
        msgs.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    return b, _decode_request(b, max_tokens, default_max_tokens, messages=tuple(msgs))


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


def chat_response(rid: str, model: str, f: Finished) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": f.text},
                         "finish_reason": f.finish_reason, "logprobs": None}],
            "usage": usage(f), "adaptive_eagle": f.spec.to_json()}


def completion_response(rid: str, model: str, f: Finished) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": f.text, "finish_reason": f.finish_reason, "logprobs": None}],
            "usage": usage(f), "adaptive_eagle": f.spec.to_json()}


def chat_chunk(rid: str, model: str, delta: dict, finished: Optional[Finished] = None) -> dict:
    out = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
           "choices": [{"index": 0, "delta": delta, "finish_reason": finished.finish_reason if finished else None,
                        "logprobs": None}]}
    if finished is not None:
        out["usage"], out["adaptive_eagle"] = usage(finished), finished.spec.to_json()
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
