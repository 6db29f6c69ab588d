"""Decoding backends behind one interface: the reference engine here, SGLang in sglang_backend.py.

Owns: the `Backend` protocol (prepare a request -> prompt ids; stream it -> token chunks, then one
`BackendResult` carrying the `TraceRecord`; a backend that checks stop strings itself gives each chunk
its final text, else the server makes it with the core's `TextStream`; `swap_head(version) -> SwapResult`; `head_version`;
`info()`), `RequestError` (a request a backend refuses, with the field at fault), and
`ReferenceBackend` around `SpeculativeEngine` + `HeadRegistry` (one `GenerationRequest` per
request; the engine cuts stop strings and makes the text), and its one-replica canary (`set_canary`). Must not touch: threads, queues, capture and the store (server.py), HTTP
(gateway.py). A backend runs at most `max_inflight` requests at once (the reference engine: one, the measured
best on a CPU); the server guarantees it.

Hot swap goes through `engine.set_head`: a request binds its head when it starts and finishes on it,
so a swap never disturbs the request in flight; a version that is missing or fails validation is
refused with the reason and the old head keeps serving. The head a swap replaced stays prepared
(`keep_previous`), and a canary's head is prepared already, so a rollback to the previous champion and
the promotion of a canary's head are a flip with nothing to load: neither competes with decoding for
the cores. Every other swap loads the version from the registry (every check, sha256 included) and
prepares it in place (`adopt`: the loaded head belongs to this engine alone).

Canary on one replica: `set_canary(version, fraction)` prepares the candidate with `engine.bind`
(not installed) and decodes `fraction` of the requests with it, chosen by a stable hash of the
request id (the same request always decodes with the same head); the trace, the response and the
live sample report the head a request actually used. Backends that cannot hold two heads at once
(SGLang) refuse it.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Iterator, Optional, Protocol, Union

import torch

from adaptive_eagle.allocator import keep_freed_memory
from adaptive_eagle.binding import HeadBinding, SwapResult
from adaptive_eagle.cpu_linear import verify_threads
from adaptive_eagle.engine import GenerationError, SpeculativeEngine
from adaptive_eagle.request import GenerationRequest, StepOutput
from adaptive_eagle.pacing import Pacer
from adaptive_eagle.registry import HeadRegistry
from adaptive_eagle.spans import message_spans
from adaptive_eagle.trace import TraceRecord
from adaptive_eagle.versions import PLAIN, engine_version, version_label
from policies.canary import Canary
from policies.holdback import Holdback
from serving import tools as T
from serving.messages import DecodeRequest


class RequestError(ValueError):
    """A request a backend will not run (empty or oversize prompt, bad parameters)."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 code: str = "invalid_request") -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


@dataclass(frozen=True)
class TokenChunk:
    token_ids: tuple[int, ...]  # tokens committed by one verify step (none: the last of the text)
    # the text that became final (stop strings cut, never half a character); None: the backend gives
    # tokens only and the server makes the text (SGLang)
    text: Optional[str] = None


@dataclass(frozen=True)
class BackendResult:
    token_ids: tuple[int, ...]  # every generated token (EOS or the stop-completing token included)
    text: str  # the completion's text (cut at its first stop string when the chunks carried text)
    finish_reason: str  # "stop" | "length"
    trace: TraceRecord  # tenant, domain and capture consent filled in
    elapsed_s: float
    arm: str = "served"  # "holdback": decoded by the frozen baseline (policies.holdback), else "served"


BackendItem = Union[TokenChunk, BackendResult]


@dataclass(frozen=True)
class HoldbackBinding:
    """The frozen baseline prepared next to the served head: which requests it takes and the bound head."""

    holdback: Holdback
    binding: HeadBinding


@dataclass(frozen=True)
class CanaryBinding:
    """A candidate head prepared next to the installed one: the policy's canary record (which requests it
    takes: policies.canary) and the bound head that decodes them."""

    canary: Canary
    binding: HeadBinding

    @property
    def version(self) -> str:
        return self.canary.version

    @property
    def fraction(self) -> float:
        return self.canary.fraction

    def takes(self, request_id: str) -> bool:
        return self.canary.takes(request_id)

    def to_json(self) -> dict:
        return self.canary.to_json()


class Backend(Protocol):
    name: str  # "reference" | "sglang"

    @property
    def head_version(self) -> str: ...  # "none": plain decoding

    def prepare(self, request: DecodeRequest) -> list[int]: ...  # prompt ids; raises RequestError

    def stream(self, request: DecodeRequest, prompt_ids: list[int], capture: bool) -> Iterator[BackendItem]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def swap_head(self, version: str) -> SwapResult: ...

    def set_canary(self, version: Optional[str], fraction: float) -> SwapResult: ...  # None ends it

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
    # one request at a time: the engine decodes one sequence (batch 1) and a CPU replica is fastest that way (a
    # second request on the same cores only stretches both); more replicas, not more requests, add throughput
    max_inflight = 1

    def __init__(self, engine: SpeculativeEngine, registry: Optional[HeadRegistry] = None,
                 max_prompt_tokens: Optional[int] = None, keep_previous: bool = True,
                 swap_cpu_share: float = 0.25) -> None:
        if not 0.0 < swap_cpu_share <= 1.0:
            raise ValueError(f"swap_cpu_share must be in (0, 1], got {swap_cpu_share}")
        self.engine, self.registry, self.max_prompt_tokens = engine, registry, max_prompt_tokens
        self.swap_cpu_share = swap_cpu_share  # of one core, while a swap reads, checks and converts a head
        self._swap_lock = threading.Lock()  # swaps are serialised; decoding never waits for them
        self._canary: Optional[CanaryBinding] = None  # read once per request (one reference)
        self._holdback: Optional[HoldbackBinding] = None  # the frozen baseline's arm (set_holdback)
        self.keep_previous = keep_previous
        self._previous: Optional[HeadBinding] = None  # what served before the last swap, still prepared

    @property
    def head_version(self) -> str:
        return version_label(self.engine.head_version)

    @property
    def canary(self) -> Optional[CanaryBinding]:
        return self._canary

    # ---- requests ------------------------------------------------------------------------------
    def prepare(self, request: DecodeRequest) -> list[int]:
        field = prompt_field(request)
        if (request.messages is None) == (request.prompt is None):
            raise RequestError("give exactly one of messages or prompt", field)
        try:
            if request.messages is not None:
                tok = self.engine.target.tokenizer
                if tok is None:
                    raise RequestError("this target has no tokenizer: pass token ids as the prompt", field)
                ids = T.template_ids(tok, T.chat_prompt(tok, request.messages, request.tools))
                if ids:
                    ids = self.engine.encode(ids)
            elif isinstance(request.prompt, str):
                ids = self._tokenize(request.prompt)
            else:
                ids = self.engine.encode(list(request.prompt))
        except (GenerationError, T.TemplateError) as e:
            raise RequestError(str(e), field) from None
        if not ids:  # a chat template can render nothing (empty messages): refused here, before a stream's 200
            raise RequestError("the prompt is empty once the chat template is applied: give non-empty content",
                               field)
        n = len(ids)
        if self.max_prompt_tokens is not None and n > self.max_prompt_tokens:
            raise RequestError(f"the prompt has {n} tokens; this server accepts at most {self.max_prompt_tokens}",
                               field, code="context_length_exceeded")
        try:
            self.engine.check_request(n, request.sampling())
        except GenerationError as e:
            prompt_fits = _fits(self.engine, n, replace(request.sampling(), max_tokens=1))
            raise RequestError(f"{e}; lower max_tokens" if prompt_fits else str(e),
                               "max_tokens" if prompt_fits else field, code="context_length_exceeded") from None
        self._grammar(request)  # compiled (and cached) before the stream starts: a bad schema is a 400
        return ids

    def _grammar(self, request: DecodeRequest):
        """The compiled grammar of a constrained request (None: free text); a format it cannot serve is refused."""
        if request.response_format is None:
            return None
        from adaptive_eagle.grammar import GrammarError

        fmt = json.loads(request.response_format)
        try:
            return self.engine.grammar(fmt)
        except (GrammarError, GenerationError) as e:  # a tool_call grammar comes from tool_choice
            raise RequestError(str(e), "tool_choice" if fmt.get("type") == "tool_call" else "response_format") from None

    def _tokenize(self, text: str) -> list[int]:
        tok = self.engine.target.tokenizer
        if not text.strip():
            raise GenerationError("empty prompt")
        if tok is None:
            raise GenerationError("this target has no tokenizer: pass token ids")
        return [int(t) for t in tok(text)["input_ids"]]

    def generation_request(self, request: DecodeRequest, prompt_ids: list[int], capture: bool) -> GenerationRequest:
        """The engine's request for `request` (prepared: `prompt_ids`); capture: the server wants hidden states."""
        generator = None
        if request.temperature > 0:
            generator = torch.Generator().manual_seed(request.seed if request.seed is not None
                                                      else int(time.time_ns() % (1 << 62)))
        return GenerationRequest(prompt_ids, request.sampling(), request.stop, capture=capture and request.capture,
                                 request_id=request.request_id, tenant=request.tenant, domain=request.domain,
                                 consent=request.capture, generator=generator, binding=self._binding_for(request),
                                 grammar=self._grammar(request))

    def stream(self, request: DecodeRequest, prompt_ids: list[int], capture: bool) -> Iterator[BackendItem]:
        gen = self.generation_request(request, prompt_ids, capture)
        held = self._holdback
        arm = "holdback" if held is not None and gen.binding is held.binding else "served"
        for item in self.engine.run(gen):
            if isinstance(item, StepOutput):
                yield TokenChunk(item.token_ids, item.text)
            else:
                yield BackendResult(tuple(item.token_ids), item.output_text, item.finish_reason,
                                    self._with_spans(item.trace, request, prompt_ids, gen.capture), item.elapsed_s, arm)

    def _with_spans(self, trace: TraceRecord, request: DecodeRequest, prompt_ids: list[int],
                    captured: bool) -> TraceRecord:
        """A captured chat request's trace with its prompt's message spans before the answer's (the engine's),
        found after the last token so that a request's time to first token never pays for them (about 50 ms
        for a 22-message, 3.3k-token session on 2 cores)."""
        tok = self.engine.target.tokenizer
        if not captured or not request.messages or tok is None:
            return trace
        chat = T.chat_prompt(tok, request.messages, request.tools)
        return replace(trace, spans=message_spans(tok, chat.messages, chat.kinds, prompt_ids, chat.tools) + trace.spans)

    def _binding_for(self, request: DecodeRequest) -> Optional[HeadBinding]:
        """The frozen baseline's binding for the holdback arm's share of requests; the canary's for its share (or
        a request that asked for its head); None: the installed head."""
        held = self._holdback
        if held is not None and request.head is None and held.holdback.takes(request.request_id):
            return held.binding
        canary = self._canary
        if canary is None:
            return None
        if request.head is not None:
            return canary.binding if request.head == canary.version else None
        return canary.binding if canary.takes(request.request_id) else None

    def decode(self, token_ids: list[int]) -> str:
        return self.engine.detokenize(token_ids)

    # ---- hot swap --------------------------------------------------------------------------------
    def _load(self, version: str):
        """The registry's `version` loaded for this target (None for plain decoding). Raises."""
        if version == PLAIN:
            return None
        if self.registry is None:
            raise RuntimeError("this server has no head registry")
        # loaded as the engine will run it: in the target's dtype, sharing the target's own embeddings (no
        # copy, no conversion of the largest tensor on a swap that competes with decoding for the cores), the
        # checksum, checks and conversions done in ~1 ms units paced to swap_cpu_share of a core
        t = self.engine.target
        return self.registry.load(version, t, device=t.device, dtype=t.dtype, share_embeddings=True,
                                  pace=Pacer(self.swap_cpu_share))

    def _prepared(self, version: str) -> Optional[HeadBinding]:
        """A binding of `version` this replica holds prepared already (its canary, or the head it served
        before the last swap), else None."""
        if self._canary is not None and self._canary.version == version:
            return self._canary.binding
        prev = self._previous
        if prev is not None and version_label(prev.version) == version:
            return prev
        return None

    def swap_head(self, version: str) -> SwapResult:
        """Serve `version` ("none": plain decoding) from the next request on; in-flight requests finish
        on their head. Missing or invalid versions are refused and the old head keeps serving. A
        canary of `version` ends: the installed head now is that version (its binding, prepared and
        calibrated during the canary, is installed as it is)."""
        with self._swap_lock:
            current = self.head_version
            t0 = time.perf_counter()
            if version == current:
                return SwapResult(True, f"{version} already serving; nothing to do", self.engine.head_version, 0.0)
            old, ready = self.engine.binding, self._prepared(version)
            if ready is not None:
                res, how = self.engine.set_head(ready), "prepared earlier: a flip"
            else:
                try:
                    loaded = self._load(version)
                except Exception as e:  # noqa: BLE001 - any refusal (missing, checksum, shape) keeps the old head
                    ms = (time.perf_counter() - t0) * 1e3
                    return SwapResult(False, f"refused {version}: {e}; {current} keeps serving",
                                      self.engine.head_version, ms)
                res, how = self.engine.set_head(loaded, engine_version(version), adopt=True), "loaded"
            if not res.ok:
                return res
            self._previous = old if self.keep_previous else None
            if self._canary is not None and self._canary.version == version:
                self._canary = None
            return replace(res, message=f"{res.message} ({how})", install_ms=(time.perf_counter() - t0) * 1e3)

    def set_holdback(self, version: Optional[str], fraction: float) -> SwapResult:
        """Decode `fraction` of requests (a hash of the request id: policies.holdback) with the frozen baseline
        `version`, prepared next to the installed head for as long as the replica runs; None ends the arm."""
        if version is None or fraction == 0:
            self._holdback = None
            return SwapResult(True, "no holdback arm: every request decodes with the served head", None)
        try:
            holdback = Holdback(version, fraction)
        except ValueError as e:
            return SwapResult(False, f"refused holdback {version}: {e}", None)
        with self._swap_lock:
            t0 = time.perf_counter()
            try:
                binding = self.engine.bind(self._load(version), engine_version(version), adopt=True)
            except Exception as e:  # noqa: BLE001 - missing, checksum, shape: no arm, and the status says why
                self._holdback = None
                return SwapResult(False, f"refused holdback {version}: {e}", None, (time.perf_counter() - t0) * 1e3)
            self._holdback = HoldbackBinding(holdback, binding)
        return SwapResult(True, f"holdback: {version} decodes {fraction:.0%} of requests next to the served head",
                          version, (time.perf_counter() - t0) * 1e3)

    def set_canary(self, version: Optional[str], fraction: float) -> SwapResult:
        """Decode `fraction` of requests (stable hash of the request id) with `version`, prepared next to
        the installed head (`engine.bind`); None ends the canary. The same version again only changes the
        fraction. SwapResult.version: the canary's version (None once it ended); a refusal changes nothing."""
        if not 0.0 <= fraction <= 1.0:
            return SwapResult(False, f"refused canary {version}: fraction must be in [0, 1], got {fraction}",
                              self._canary.version if self._canary else None)
        with self._swap_lock:
            current, t0 = self._canary, time.perf_counter()
            if version is None:
                self._canary = None
                what = f"canary of {current.version} ended" if current else "no canary was running"
                return SwapResult(True, f"{what}; {self.head_version} serves every request", None)
            if current is not None and current.version == version:
                self._canary = replace(current, canary=Canary(version, fraction))
                return SwapResult(True, f"canary {version} now takes {fraction:.0%} of requests", version)
            if version == self.head_version:
                return SwapResult(False, f"refused canary {version}: it already serves every request",
                                  current.version if current else None)
            try:
                binding = self._prepared(version) or self.engine.bind(
                    self._load(version), engine_version(version), adopt=True)
            except Exception as e:  # noqa: BLE001 - missing, checksum, shape: the old canary (if any) stays
                return SwapResult(False, f"refused canary {version}: {e}", current.version if current else None,
                                  (time.perf_counter() - t0) * 1e3)
            self._canary = CanaryBinding(Canary(version, fraction), binding)
            return SwapResult(True, f"canary {version} takes {fraction:.0%} of requests next to {self.head_version}",
                              version, (time.perf_counter() - t0) * 1e3)

    def info(self) -> dict:
        t = self.engine.target
        return {"backend": self.name, "target": t.name, "target_fingerprint": t.fingerprint, "compute": t.compute,
                "prefill": t.prefill_choice or t.compute, "lossless": t.lossless, "head_version": self.head_version,
                "verify_threads": verify_threads(t.compute) if t.device.type == "cpu" else None,
                "engine": asdict(self.engine.config),
                "registry": str(self.registry.root) if self.registry is not None else None,
                "max_prompt_tokens": self.max_prompt_tokens, "context": t.config.max_position_embeddings,
                "canary": self._canary.to_json() if self._canary is not None else None,
                "holdback": self._holdback.holdback.to_json() if self._holdback is not None else None,
                "previous_head": None if self._previous is None else version_label(self._previous.version),
                # cumulative counts, exported as ae_backend_events{event=...} (serving/metrics.py)
                "counts": self.engine.prefix_cache.counts.as_dict(),
                "prefix_cache_bytes": self.engine.prefix_cache.nbytes,
                "allocator": keep_freed_memory() if t.device.type == "cpu" else None}


def _fits(engine: SpeculativeEngine, n_prompt: int, sampling) -> bool:
    try:
        engine.check_request(n_prompt, sampling)
        return True
    except GenerationError:
        return False
