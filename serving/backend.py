"""Decoding backends behind one interface: the reference engine here, SGLang in sglang_backend.py.

Owns: the `Backend` protocol (prepare a request -> prompt ids; stream it -> token chunks, then one
`BackendResult` carrying the `TraceRecord`; `swap_head(version) -> SwapResult`; `head_version`;
`info()`), `RequestError` (a request a backend refuses, with the field at fault), and
`ReferenceBackend` around `SpeculativeEngine` + `HeadRegistry`. Must not touch: threads, queues,
capture and the store (server.py), HTTP (gateway.py). A backend runs one request at a time; the
server guarantees it.

Hot swap goes through `engine.set_head`: a request binds its head when it starts and finishes on it,
so a swap never disturbs the request in flight; a version that is missing or fails validation is
refused with the reason and the old head keeps serving.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Iterator, Optional, Protocol, Union

import torch

from adaptive_eagle.binding import SwapResult
from adaptive_eagle.engine import GenerationError, SpeculativeEngine
from adaptive_eagle.registry import HeadRegistry
from adaptive_eagle.trace import TraceRecord
from serving.messages import PLAIN, DecodeRequest


class RequestError(ValueError):
    """A request a backend will not run (empty or oversize prompt, bad parameters)."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 code: str = "invalid_request") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


@dataclass(frozen=True)
class TokenChunk:
    token_ids: tuple[int, ...]  # tokens committed by one verify step


@dataclass(frozen=True)
class BackendResult:
    token_ids: tuple[int, ...]  # every generated token (EOS or the stop-completing token included)
    text: str  # the engine's text (stop strings not yet cut)
    finish_reason: str  # "stop" | "length"
    trace: TraceRecord  # tenant, domain and capture consent filled in
    elapsed_s: float


BackendItem = Union[TokenChunk, BackendResult]


class Backend(Protocol):
    name: str  # "reference" | "sglang"

    @property
    def head_version(self) -> str: ...  # "none": plain decoding

    def prepare(self, request: DecodeRequest) -> list[int]: ...  # prompt ids; raises RequestError

    def stream(self, request: DecodeRequest, prompt_ids: list[int], capture: bool) -> Iterator[BackendItem]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def swap_head(self, version: str) -> SwapResult: ...

    def info(self) -> dict: ...


def generate(backend: Backend, request: DecodeRequest, capture: bool = False) -> BackendResult:
    """Run one request to the end (no server around it: tests, benchmarks)."""
    result = None
    for item in backend.stream(request, backend.prepare(request), capture):
        if isinstance(item, BackendResult):
            result = item
    return result


def prompt_field(request: DecodeRequest) -> str:
    return "messages" if request.messages is not None else "prompt"


class ReferenceBackend:
    """The reference engine (CPU or CUDA) with heads from a registry."""

    name = "reference"

    def __init__(self, engine: SpeculativeEngine, registry: Optional[HeadRegistry] = None,
                 max_prompt_tokens: Optional[int] = None) -> None:
        self.engine, self.registry, self.max_prompt_tokens = engine, registry, max_prompt_tokens
        self._swap_lock = threading.Lock()  # swaps are serialised; decoding never waits for them

    @property
    def head_version(self) -> str:
        return PLAIN if self.engine.head_version is None else self.engine.head_version

    # ---- requests ------------------------------------------------------------------------------
    def prepare(self, request: DecodeRequest) -> list[int]:
        field = prompt_field(request)
        if (request.messages is None) == (request.prompt is None):
            raise RequestError("give exactly one of messages or prompt", field)
        try:
            if request.messages is not None:
                ids = self.engine.encode([dict(m) for m in request.messages])
            elif isinstance(request.prompt, str):
                ids = self._tokenize(request.prompt)
            else:
                ids = self.engine.encode(list(request.prompt))
        except GenerationError as e:
            raise RequestError(str(e), field) from None
        n = len(ids)
        if self.max_prompt_tokens is not None and n > self.max_prompt_tokens:
            raise RequestError(f"the prompt has {n} tokens; this server accepts at most {self.max_prompt_tokens}",
                               field, code="context_length_exceeded")
        context = self.engine.target.config.max_position_embeddings
        lookahead = self.engine.config.num_draft_tokens + 1  # the engine re-checks this (engine._check_limits)
        if n + request.max_tokens + lookahead > context:
            room = max(0, context - n - lookahead)
            raise RequestError(f"prompt ({n} tokens) + max_tokens ({request.max_tokens}) exceeds the context "
                               f"({context}); max_tokens may be at most {room} for this prompt",
                               "max_tokens" if room else field, code="context_length_exceeded")
        return ids

    def _tokenize(self, text: str) -> list[int]:
        tok = self.engine.target.tokenizer
        if not text.strip():
            raise GenerationError("empty prompt")
        if tok is None:
            raise GenerationError("this target has no tokenizer: pass token ids")
        return [int(t) for t in tok(text)["input_ids"]]

    def stream(self, request: DecodeRequest, prompt_ids: list[int], capture: bool) -> Iterator[BackendItem]:
        generator = None
        if request.temperature > 0:
            generator = torch.Generator().manual_seed(request.seed if request.seed is not None
                                                      else int(time.time_ns() % (1 << 62)))
        for new, result in self.engine.stream(prompt_ids, request.sampling(), list(request.stop) or None,
                                              capture=capture and request.capture, request_id=request.request_id,
                                              generator=generator, tenant=request.tenant,
                                              index_output=request.capture):
            if new:
                yield TokenChunk(tuple(new))
            if result is not None:
                trace = replace(result.trace, domain=request.domain, capture_consent=request.capture)
                yield BackendResult(tuple(result.token_ids), result.text, result.finish_reason, trace,
                                    result.elapsed_s)

    def decode(self, token_ids: list[int]) -> str:
        tok = self.engine.target.tokenizer
        if tok is None:
            return " ".join(str(t) for t in token_ids)
        return tok.decode([t for t in token_ids if t not in self.engine.eos_ids], skip_special_tokens=True)

    # ---- hot swap --------------------------------------------------------------------------------
    def swap_head(self, version: str) -> SwapResult:
        """Serve `version` ("none": plain decoding) from the next request on; in-flight requests finish
        on their head. Missing or invalid versions are refused and the old head keeps serving."""
        with self._swap_lock:
            current = self.head_version
            if version == PLAIN:
                return self.engine.set_head(None)
            t0 = time.perf_counter()
            if self.registry is None:
                return SwapResult(False, f"refused {version}: this server has no head registry; {current} keeps "
                                         "serving", self.engine.head_version, 0.0)
            try:
                loaded = self.registry.load(version, self.engine.target, device=self.engine.target.device)
            except Exception as e:  # noqa: BLE001 - any refusal (missing, checksum, shape) keeps the old head
                ms = (time.perf_counter() - t0) * 1e3
                return SwapResult(False, f"refused {version}: {e}; {current} keeps serving", self.engine.head_version,
                                  ms)
            res = self.engine.set_head(loaded, version)
            return replace(res, install_ms=(time.perf_counter() - t0) * 1e3)

    def info(self) -> dict:
        t = self.engine.target
        return {"backend": self.name, "target": t.name, "target_fingerprint": t.fingerprint, "compute": t.compute,
                "lossless": t.lossless, "head_version": self.head_version, "engine": asdict(self.engine.config),
                "registry": str(self.registry.root) if self.registry is not None else None,
                "max_prompt_tokens": self.max_prompt_tokens, "context": t.config.max_position_embeddings}
