"""DecodeServer: one replica, Ray-free. A backend, a capture sampler and an optional store writer.

Owns: running up to `max_inflight` requests at once, its backend's capacity (the reference engine: one;
SGLang: what its continuous batching runs at once), each on its own decode thread (`stream` on the
caller's thread once a slot is free; `astream` on the replica's pool of `max_inflight` decode threads, so
an event loop stays responsive while the replica decodes), text deltas (the backend's, whose engine cuts stop strings; for a backend
that gives tokens only (SGLang) the core's `TextStream` makes them: adaptive_eagle.stopping is the
one home of stop strings), capture (decide after the request, `StoreWriter.put` never blocks or raises), the
speculative metrics of each response, counters and status, the hot-swap entry point
`swap_head(version) -> SwapResult` and the one-replica canary `set_canary(version, fraction)`. Must not touch: HTTP, routing, Ray (actor.py is the shell).

A swap runs while requests decode: the engine binds a request's head when it starts, so the
requests in flight finish on their head and the next ones use the new head (SGLang's backend drains
its server instead, as SGLang's own weight-update lock does). The swap's own work
(read and check the version, prepare it for the target) runs on the replica's swap thread at a
lower CPU priority (nice +PREPARE_NICE, Linux), so on a busy machine it takes the cores the decode
thread leaves idle instead of stretching the in-flight request's steps.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator, Iterator, Optional

from adaptive_eagle.binding import SwapResult
from adaptive_eagle.engine import GenerationError
from adaptive_eagle.grammar import GrammarError
from adaptive_eagle.stopping import TextStream
from adaptive_eagle.versions import version_label
from serving.backend import Backend, BackendResult, RequestError, TokenChunk
from serving.capture import CapturePolicy, CaptureSampler
from serving.messages import (DecodeRequest, Delta, Event, Finished, Refused, ServerStatus, SpecMetrics,
                              Started)
from serving.metrics import context_fields

log = logging.getLogger(__name__)
_DONE = object()
PREPARE_NICE = 10  # how much lower than decoding a swap's preparation runs (Linux niceness; 19 is the lowest)


def lower_priority(nice: int = PREPARE_NICE) -> None:
    """Raise the calling thread's niceness by `nice` (threads it starts inherit it). Best effort: a no-op where
    the OS has no per-thread priorities."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    except (AttributeError, OSError) as e:  # not Linux, or not permitted
        log.debug("swap thread keeps its priority: %s", e)


def settle_heap() -> None:
    """Collect once, then freeze everything alive (the target, the tokenizer, every imported module: some 400k
    objects for SmolLM2) out of the garbage collector's reach. A full collection otherwise walks all of them,
    holding the interpreter lock for ~0.2 s on a small CPU: a stall of every decoding request whenever it
    happens. Frozen, it walks only what serving allocated since. Called once a process's replicas are built."""
    gc.collect()
    gc.freeze()


@dataclass
class _Clock:
    """When the replica started a request's backend stream, saw its first token and its result (perf_counter)."""

    start: float
    first: Optional[float] = None
    end: Optional[float] = None

    def split(self, n: int, elapsed_s: float) -> tuple[float, float]:
        """(time to first token, time per output token after the first), seconds; the backend's elapsed time
        stands in for a clock that saw no token."""
        end = self.end if self.end is not None else self.start + elapsed_s
        first = self.first if self.first is not None else end
        ttft = first - self.start
        return ttft, ((end - first) / (n - 1) if n > 1 else 0.0)


def spec_metrics(result: BackendResult, backend: str, replica: str, captured: str, domain,
                 clock: _Clock) -> SpecMetrics:
    steps = result.trace.steps
    n = len(result.token_ids)
    ttft, tpot = clock.split(n, result.elapsed_s)
    return SpecMetrics(
        head_version=version_label(result.trace.head_version), accept_length=round(result.trace.accept_length_mean, 4),
        verify_steps=len(steps), draft_tokens=sum(s.tree_size for s in steps),
        accepted_drafts=sum(s.accept_length for s in steps), plain_steps=sum(s.tree_size == 0 for s in steps),
        backend=backend, replica=replica,
        elapsed_s=round(result.elapsed_s, 6), tpot_s=round(tpot, 6), ttft_s=round(ttft, 6),
        tokens_per_s=round(n / result.elapsed_s, 3) if result.elapsed_s > 0 else 0.0, captured=captured,
        domain=domain, arm=getattr(result, "arm", "served"), **context_fields(result.trace))


class DecodeServer:
    def __init__(self, backend: Backend, capture: Optional[CapturePolicy] = None, writer=None, *,
                 name: str = "replica-0", owns_writer: bool = False) -> None:
        """writer: a feature_store StoreWriter (or anything with put/stats), None = nothing stored;
        owns_writer: `close` closes it too (a server built by serving.replicas)."""
        self.backend, self.writer, self.name, self.owns_writer = backend, writer, name, owns_writer
        self.sampler = CaptureSampler(capture or CapturePolicy(enabled=False))
        self.max_inflight = int(getattr(backend, "max_inflight", 1))
        if self.max_inflight < 1:
            raise ValueError(f"backend {backend.name}: max_inflight must be >= 1, got {self.max_inflight}")
        self._slots = threading.BoundedSemaphore(self.max_inflight)  # requests decoding at once
        self._executor = ThreadPoolExecutor(self.max_inflight, thread_name_prefix=f"decode-{name}")
        self._swapper = ThreadPoolExecutor(1, thread_name_prefix=f"swap-{name}", initializer=lower_priority)
        self._lock = threading.Lock()
        self._c = {"running": 0, "waiting": 0, "served": 0, "refused": 0, "failed": 0, "cancelled": 0,
                   "capture_dropped": 0, "grammar_failed": 0}

    def _count(self, key: str, delta: int = 1) -> None:
        with self._lock:
            self._c[key] += delta

    # ---- requests -----------------------------------------------------------------------------
    def stream(self, request: DecodeRequest, cancel: Optional[threading.Event] = None) -> Iterator[Event]:
        """Run one request on the caller's thread once one of the replica's max_inflight slots is free:
        Started (or Refused), Delta*, then Finished."""
        self._count("waiting")
        with self._slots:
            self._count("waiting", -1)
            self._count("running")
            try:
                yield from self._run(request, cancel or threading.Event())
            finally:
                self._count("running", -1)

    def _run(self, request: DecodeRequest, cancel: threading.Event) -> Iterator[Event]:
        if cancel.is_set():  # the caller left while the request was queued
            self._count("cancelled")
            return
        try:
            prompt_ids = self.backend.prepare(request)
        except RequestError as e:
            self._count("refused")
            yield Refused(e.status, e.message, e.param, e.code)
            return
        yield Started(request.request_id, len(prompt_ids), self.name)
        text: Optional[TextStream] = None  # made for a backend whose chunks carry tokens only
        result = None
        clock = _Clock(time.perf_counter())
        items = self.backend.stream(request, prompt_ids, self.sampler.wants_hidden(request.capture))
        try:
            for item in items:
                if cancel.is_set():
                    self._count("cancelled")
                    return
                if isinstance(item, TokenChunk):
                    if clock.first is None and item.token_ids:
                        clock.first = time.perf_counter()
                    if item.text is None:
                        text = text or TextStream(self.backend.decode, request.stop)
                    if delta := (item.text if item.text is not None else text.push(item.token_ids)):
                        yield Delta(delta, item.token_ids)
                elif isinstance(item, BackendResult):
                    result, clock.end = item, time.perf_counter()
        except GrammarError as e:  # a constrained request's format cannot go on: ended, counted
            self._count("grammar_failed")
            yield Refused(400, f"response_format: {e}", "response_format")
            return
        except (GenerationError, RequestError) as e:
            self._count("refused")
            yield Refused(400, str(e))
            return
        except Exception as e:  # noqa: BLE001 - one failed request must not take the replica down
            log.exception("replica %s: request %s failed", self.name, request.request_id)
            self._count("failed")
            yield Refused(500, f"decoding failed: {type(e).__name__}: {e}", code="server_error")
            return
        finally:
            items.close()
        yield from self._finish(request, prompt_ids, text, result, clock)

    def _finish(self, request: DecodeRequest, prompt_ids, text: Optional[TextStream], result: BackendResult,
                clock: _Clock) -> Iterator[Event]:
        full = result.text  # the backend cut it, and its chunks carried the text
        if text is not None:
            full, rest = text.finish(result.token_ids)
            if rest:
                yield Delta(rest)
        captured = self._capture(request, result)
        spec = spec_metrics(result, self.backend.name, self.name, captured, request.domain, clock)
        self._count("served")
        yield Finished(request.request_id, full, result.finish_reason, len(prompt_ids), len(result.token_ids), spec)

    def _capture(self, request: DecodeRequest, result: BackendResult) -> str:
        trace = result.trace
        hidden = trace.aux_hidden.nbytes if trace.aux_hidden is not None else 0
        d = self.sampler.decide(trace.accept_length_mean, version_label(trace.head_version), hidden,
                                8 * len(trace.input_ids), consent=request.capture)
        if self.writer is None:
            return d.label if not d.keep else "no"
        if not request.capture:
            self.writer.put(trace.without_hidden())  # never stored: the writer counts the opt-out
            return d.label
        if not d.keep:
            return d.label
        if self.writer.put(trace if d.hidden else trace.without_hidden()):  # never blocks, never raises
            return d.label
        self._count("capture_dropped")
        return "dropped"

    def generate(self, request: DecodeRequest) -> Finished | Refused:
        last = None
        for event in self.stream(request):
            if isinstance(event, (Finished, Refused)):
                last = event
        return last

    async def astream(self, request: DecodeRequest) -> AsyncIterator[Event]:
        """`stream` on one of the replica's decode threads; the caller's event loop stays free. Leaving the
        iteration early cancels the request between verify steps."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def post(item) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop is gone: nobody is listening any more
                cancel.set()

        def work() -> None:
            try:
                for event in self.stream(request, cancel):
                    post(event)
            except BaseException as e:  # noqa: BLE001 - reported to the caller, never lost
                post(Refused(500, f"decoding failed: {type(e).__name__}: {e}", code="server_error"))
            finally:
                post(_DONE)

        self._count("waiting")  # until the decode thread picks it up (stream counts it again there)

        def run() -> None:
            self._count("waiting", -1)
            work()

        loop.run_in_executor(self._executor, run)
        try:
            while (item := await queue.get()) is not _DONE:
                yield item
        finally:
            cancel.set()  # a request still queued stops before its first verify step

    # ---- swap and status ----------------------------------------------------------------------
    def swap_head(self, version: str) -> SwapResult:
        """Serve `version` ("none" = plain decoding) from the next request on. Never waits for, fails
        or stalls the request in flight."""
        res = self._swapper.submit(self.backend.swap_head, version).result()
        log.info("replica %s: swap to %s: %s", self.name, version, res.message)
        return res

    def set_canary(self, version: Optional[str], fraction: float) -> SwapResult:
        """Decode `fraction` of requests (stable hash of the request id) with `version` next to the installed
        head, on this replica; None ends it. Refused by backends that hold one head (SGLang)."""
        res = self._swapper.submit(self.backend.set_canary, version, fraction).result()
        log.info("replica %s: canary %s (%.2f): %s", self.name, version, fraction, res.message)
        return res

    @property
    def head_version(self) -> str:
        return self.backend.head_version

    def status(self) -> ServerStatus:
        with self._lock:
            c = dict(self._c)
        store = None
        if self.writer is not None:
            try:
                s = self.writer.stats()
                store = s.__dict__ if hasattr(s, "__dict__") else dict(s)
            except Exception as e:  # noqa: BLE001 - status never fails because of the store
                store = {"error": str(e)}
        capture = dict(self.sampler.stats(), dropped_at_put=c["capture_dropped"])
        return ServerStatus(replica=self.name, head_version=self.backend.head_version, backend=self.backend.name,
                            running=c["running"], waiting=c["waiting"], served=c["served"], refused=c["refused"],
                            failed=c["failed"], cancelled=c["cancelled"], capture=capture, store=store,
                            info=self.backend.info(), pid=os.getpid(), max_inflight=self.max_inflight,
                            grammar_failed=c["grammar_failed"])

    def close(self) -> None:
        """Stop the decode threads (after the requests in flight), then the backend's resources; the writer
        belongs to the caller unless the server owns it."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._swapper.shutdown(wait=True, cancel_futures=True)
        if (close := getattr(self.backend, "close", None)) is not None:
            close()
        if self.owns_writer and self.writer is not None:
            self.writer.close()
