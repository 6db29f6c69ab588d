"""The SGLang backend (optional extra `adaptive-eagle[sglang]`, GPU only, never installed by CI).

Owns: the `sglang.launch_server` arguments for EAGLE-3 (`SGLangConfig.launch_args`) and the server
process a replica launched (`launch_sglang`), streaming /generate into token chunks and a
`TraceRecord` per request (tokens and per-request acceptance; no hidden states, see
docs/architecture.md), and the draft-head swap: in place through SGLang's weight-update session with
the "draft" selector, checked by checksums afterwards, else by restarting this replica's server on
the new head. Must not touch: sglang's Python package (this module talks HTTP; only the marked test
imports sglang), the wire format itself (sglang_protocol.py), the engine, the decode and swap threads
and capture (server.py).

Requests: many at once (up to `SGLangConfig.inflight_limit`, by default what SGLang itself batches), so
SGLang's continuous batching sees the replica's whole load; the server (DecodeServer) bounds how many.

A swap, step by step (`swap_head`): read and check the version's files; drain (new requests wait, the
requests in flight finish: SGLang's tokenizer manager does the same with its model_update_lock, readers
for generate and the writer for a weight update, so a swap is a pause, never a flip); if the head can be loaded in place (same config and draft vocabulary
as the head the server was launched with), checksum target and draft, load the draft in one session
labelled with the version, checksum again and keep it only if the target is unchanged and the draft
changed as the files say it must; otherwise, or when the session is refused or its result rejected,
restart: stop the server, launch it on the new head with `--weight-version <version>`, wait for
/health, warm up, serve (a failed restart launches it on the previous head again). A server this
replica did not launch cannot be restarted: a rejected update is undone in place, and when the
checksums do not come back the backend refuses requests until a swap succeeds. SGLang's update from
disk is never used for a draft: it has no selector and loads the path into the target first.

Version labels: the server is launched with `--weight-version` and every swap sets the label, so each
response's `meta_info.weight_version` names the head that served it; traces, live samples and
metrics carry that label.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from adaptive_eagle.binding import SwapResult
from adaptive_eagle.spans import answer_span, message_spans
from adaptive_eagle.trace import TraceRecord
from adaptive_eagle.versions import PLAIN, engine_version
from serving import tools as T
from serving.backend import BackendItem, BackendResult, RequestError, TokenChunk, prompt_field
from serving.messages import DecodeRequest
from serving.sglang_protocol import (ENDPOINTS, SGLangAborted, SGLangError, SGLangProtocolError, StreamAssembler,
                                     error_of, finish_reason_of, generate_body, served_version,
                                     verify_steps_from_meta, warmup_body)
from serving.sglang_swap import DraftWeights, WeightSession, hot_swap_blocker

# launch flags this config sets itself: extra_args may not repeat them
MANAGED_FLAGS = ("--model-path", "--host", "--port", "--speculative-algorithm", "--speculative-draft-model-path",
                 "--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens",
                 "--weight-version", "--tp-size", "--enable-metrics", "--incremental-streaming-output",
                 "--max-running-requests")
# what an SGLang 0.5.23 EAGLE-3 server runs at once when --max-running-requests is not given: its
# speculative_hook._handle_eagle_family sets max_running_requests=48 (test_sglang_contract.py reads it)
EAGLE_MAX_RUNNING_REQUESTS = 48


class SGLangConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: str = Field(..., description="target model directory (local)")
    draft_model_path: str = Field(..., description="EAGLE-3 head directory (LlamaForCausalLMEagle3 layout)")
    weight_version: Optional[str] = Field(None, min_length=1, description="--weight-version: the label of the "
                                          "head the server starts with; None: the head directory's name")
    host: str = Field("127.0.0.1")
    port: int = Field(30000, ge=1, le=65535)
    num_steps: int = Field(5, ge=1, description="--speculative-num-steps (draft depth)")
    eagle_topk: int = Field(4, ge=1, description="--speculative-eagle-topk")
    num_draft_tokens: int = Field(16, ge=2, description="--speculative-num-draft-tokens (tree size, root included)")
    tp_size: int = Field(1, ge=1, description="--tp-size; a weight update sends one payload per rank")
    incremental_streaming: bool = Field(True, description="--incremental-streaming-output: each chunk carries only "
                                        "its new tokens (either way the stream is read correctly)")
    swap: Literal["session", "restart"] = Field("session", description="session: load the draft in place when the "
                                                "head allows it, restart otherwise; restart: always restart")
    max_update_bytes: int = Field(256 << 20, ge=1 << 20, description="tensor bytes per /update_weights_from_tensor")
    extra_args: tuple[str, ...] = Field((), description="more launch_server arguments, passed as given")
    timeout_s: float = Field(600.0, gt=0, description="HTTP timeout of one request (a swap's drain included)")
    max_prompt_tokens: Optional[int] = Field(None, ge=1)
    max_running_requests: Optional[int] = Field(None, ge=1, description="--max-running-requests: the requests "
                                                "SGLang batches at once; None: SGLang's own default "
                                                f"({EAGLE_MAX_RUNNING_REQUESTS} for EAGLE-3)")
    max_inflight: Optional[int] = Field(None, ge=1, description="requests this replica sends SGLang at once (more "
                                        "wait in the replica's queue); None: what SGLang runs at once "
                                        "(max_running_requests, else its EAGLE-3 default)")
    launch: bool = Field(False, description="start sglang.launch_server as a child of the replica (stopped when "
                         "the replica closes, restarted by a swap that cannot load in place); False: the server "
                         "is started separately and such swaps are refused")
    startup_timeout_s: float = Field(900.0, gt=0, description="wait this long for a launched server's /health")
    health_poll_s: float = Field(2.0, gt=0, description="seconds between /health polls while a server starts")

    @field_validator("extra_args")
    @classmethod
    def _unmanaged(cls, args: tuple[str, ...]) -> tuple[str, ...]:
        taken = [a for a in args if a.split("=", 1)[0] in MANAGED_FLAGS]
        if taken:
            raise ValueError(f"extra_args repeats {', '.join(taken)}: set the matching sglang field instead")
        return args

    @property
    def inflight_limit(self) -> int:
        """Requests in flight at once on this replica: max_inflight, else what SGLang batches."""
        return self.max_inflight or self.max_running_requests or EAGLE_MAX_RUNNING_REQUESTS

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def head_label(self) -> str:
        """The --weight-version the server is launched with."""
        return self.weight_version or Path(self.draft_model_path).name

    def launch_args(self, python: str = sys.executable) -> list[str]:
        args = [python, "-m", "sglang.launch_server", "--model-path", self.model_path, "--host", self.host,
                "--port", str(self.port), "--speculative-algorithm", "EAGLE3",
                "--speculative-draft-model-path", self.draft_model_path,
                "--speculative-num-steps", str(self.num_steps), "--speculative-eagle-topk", str(self.eagle_topk),
                "--speculative-num-draft-tokens", str(self.num_draft_tokens), "--weight-version", self.head_label,
                "--enable-metrics"]
        if self.tp_size > 1:
            args += ["--tp-size", str(self.tp_size)]
        if self.max_running_requests is not None:
            args += ["--max-running-requests", str(self.max_running_requests)]
        if self.incremental_streaming:
            args.append("--incremental-streaming-output")
        return args + list(self.extra_args)


def launch_sglang(config: SGLangConfig, client=None, args: Optional[list[str]] = None,
                  spawn: Callable[[list[str]], subprocess.Popen] = subprocess.Popen) -> subprocess.Popen:
    """Start `sglang.launch_server` with `config.launch_args()` (or `args`) and wait until it answers
    /health; raises RuntimeError (the process stopped) or TimeoutError, after stopping it."""
    import httpx

    args = args or config.launch_args()
    proc = spawn(args)
    client = client or httpx.Client(base_url=config.base_url, timeout=5.0)
    deadline = time.monotonic() + config.startup_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sglang.launch_server exited with {proc.returncode}: {' '.join(args)}")
        try:
            if client.get(ENDPOINTS["health"].path).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(config.health_poll_s)
    stop_process(proc)
    raise TimeoutError(f"sglang did not answer /health at {config.base_url} within {config.startup_timeout_s:g} s")


def stop_process(proc, wait_s: float = 30.0) -> None:
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(wait_s)


class Gate:
    """Many requests at once, or one swap: SGLang's own model-update lock, mirrored (its tokenizer manager holds
    a readers-writer lock, requests read and a weight update writes, so running requests drain and new ones
    wait). A swap that waits goes before any request that arrives after it (a stream of requests must not
    starve it). How many requests run at once is the server's to bound (DecodeServer, max_inflight)."""

    def __init__(self) -> None:
        self._cond, self._running, self._swapping, self._swaps_waiting = threading.Condition(), 0, False, 0

    @property
    def running(self) -> int:
        return self._running

    @contextmanager
    def request(self):
        with self._cond:
            self._cond.wait_for(lambda: not self._swapping and not self._swaps_waiting)
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    @contextmanager
    def swap(self):
        with self._cond:
            self._swaps_waiting += 1
            self._cond.wait_for(lambda: not self._swapping and not self._running)
            self._swaps_waiting -= 1
            self._swapping = True
        try:
            yield
        finally:
            with self._cond:
                self._swapping = False
                self._cond.notify_all()


def _failure_kind(e: Exception) -> str:
    """The backend counter of a request SGLang did not finish."""
    if isinstance(e, RequestError):
        return "refused_by_sglang"
    if isinstance(e, SGLangAborted):
        return "aborted"
    return "protocol_errors" if isinstance(e, SGLangProtocolError) else "broken_streams"


def trace_from_response(request: DecodeRequest, prompt_ids: list[int], output_ids: list[int], meta: dict,
                        head_version: str, fingerprint: str, draft_tokens: int, tokenizer=None) -> TraceRecord:
    """The trace of an SGLang answer; with `tokenizer` (a request the server captures), a chat request's prompt
    spans (adaptive_eagle.spans)."""
    ids = list(prompt_ids) + list(output_ids)
    spans = ()
    if tokenizer is not None and request.messages and request.capture:
        chat = T.chat_prompt(tokenizer, request.messages, request.tools)
        spans = message_spans(tokenizer, chat.messages, chat.kinds, prompt_ids, chat.tools)
    spans += answer_span(len(prompt_ids), len(ids), request.response_format is not None)
    return TraceRecord(request_id=request.request_id, target_fingerprint=fingerprint,
                       head_version=engine_version(head_version), backend="sglang",
                       input_ids=tuple(ids), loss_mask=tuple([0] * len(prompt_ids) + [1] * len(output_ids)),
                       steps=verify_steps_from_meta(meta, draft_tokens), tenant=request.tenant,
                       sampling=request.sampling(), domain=request.domain, capture_consent=request.capture,
                       spans=spans)


class SGLangBackend:
    """One SGLang server. `tokenizer`: the target's Hugging Face tokenizer (prompt ids and limits are checked
    here, before the request is sent). `process`: a server this backend launched (`launch_sglang`): `close`
    stops it and a swap that cannot load in place restarts it. `spawn`: how a restart starts the process."""

    name = "sglang"

    def __init__(self, config: SGLangConfig, tokenizer, registry=None, head_version: str = PLAIN,
                 fingerprint: str = "", client=None, process: Optional[subprocess.Popen] = None,
                 spawn: Callable[[list[str]], subprocess.Popen] = subprocess.Popen) -> None:
        import httpx

        self.cfg, self.tokenizer, self.registry, self.process, self.spawn = config, tokenizer, registry, process, spawn
        self._version, self.fingerprint = head_version, fingerprint
        self.max_inflight = config.inflight_limit  # DecodeServer runs this many requests at once
        # one connection per request in flight, and room for a swap's and the status calls (httpx's pool
        # would otherwise queue streams beyond its default 100 connections)
        limits = httpx.Limits(max_connections=self.max_inflight + 4, max_keepalive_connections=self.max_inflight + 4)
        self.client = client or httpx.Client(base_url=config.base_url, timeout=config.timeout_s, limits=limits)
        self._gate = Gate()  # many requests at once, or one swap; a waiting swap goes before new requests
        self._swap_lock = threading.Lock()
        self._down: Optional[str] = None  # why the server cannot serve (a restart that failed twice)
        self._served_dir = Path(config.draft_model_path)  # the head the draft holds now
        self._checksums = None  # the last verified Checksums (the target's never changes)
        self._draft_sums: dict[str, str] = {}  # version -> draft checksum seen serving it on this server
        self._count_lock = threading.Lock()
        self.counts = {"aborted": 0, "refused_by_sglang": 0, "broken_streams": 0, "protocol_errors": 0,
                       "straddled_requests": 0, "session_swaps": 0, "restart_swaps": 0, "refused_swaps": 0}
        self.last_swap: dict = {}

    @property
    def head_version(self) -> str:
        return self._version

    def _count(self, key: str) -> None:
        with self._count_lock:
            self.counts[key] += 1

    # ---- requests ------------------------------------------------------------------------------
    def prepare(self, request: DecodeRequest) -> list[int]:
        field = prompt_field(request)
        if request.messages is not None:
            try:
                ids = T.template_ids(self.tokenizer, T.chat_prompt(self.tokenizer, request.messages, request.tools))
            except T.TemplateError as e:
                raise RequestError(str(e), field) from None
        elif isinstance(request.prompt, str):
            ids = list(self.tokenizer(request.prompt)["input_ids"])
        else:
            ids = list(request.prompt or ())
        if not ids:
            raise RequestError("empty prompt", field)
        if self.cfg.max_prompt_tokens is not None and len(ids) > self.cfg.max_prompt_tokens:
            raise RequestError(f"the prompt has {len(ids)} tokens; this server accepts at most "
                               f"{self.cfg.max_prompt_tokens}", field, code="context_length_exceeded")
        return [int(t) for t in ids]

    def stream(self, request: DecodeRequest, prompt_ids: list[int], capture: bool) -> Iterator[BackendItem]:
        """Streams /generate. The trace carries tokens only and the trainer regenerates hidden states
        (docs/architecture.md says why); `capture` (the server keeps this request) adds the prompt's spans. An abort, an error chunk, a broken or unfinished stream
        raise (RequestError when SGLang refused the request, else SGLangError): never a truncated answer."""
        t0 = time.perf_counter()
        with self._gate.request():
            if self._down is not None:
                raise SGLangError(f"the SGLang server of this replica is down: {self._down}")
            asm = StreamAssembler()
            try:
                meta, finish = yield from self._read_stream(request, prompt_ids, asm)
            except (RequestError, SGLangError) as e:
                self._count(_failure_kind(e))
                raise
        version, straddled = served_version(meta, self._version)
        if straddled:
            self._count("straddled_requests")
        trace = trace_from_response(request, prompt_ids, asm.tokens, meta, version, self.fingerprint,
                                    self.cfg.num_draft_tokens - 1, self.tokenizer if capture else None)
        yield BackendResult(tuple(asm.tokens), self.decode(asm.tokens), finish, trace, time.perf_counter() - t0)

    def _read_stream(self, request: DecodeRequest, prompt_ids: list[int], asm: StreamAssembler):
        """Yields TokenChunks; returns (the last meta_info, the finish reason)."""
        import httpx

        meta, finish, ep = {}, None, ENDPOINTS["generate"]
        try:
            with self.client.stream(ep.method, ep.path, json=generate_body(request, prompt_ids)) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise error_of({"error": {"message": f"{resp.status_code}: {resp.text[:300]}",
                                              "code": resp.status_code}})
                for line in resp.iter_lines():
                    data = line[5:].strip() if line.startswith("data:") else None
                    if not data:
                        continue
                    if data == "[DONE]":
                        break
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        raise SGLangProtocolError(f"a streamed chunk that is not JSON: {data[:200]}") from None
                    if "error" in chunk:
                        raise error_of(chunk)
                    meta = chunk.get("meta_info") or {}
                    new = asm.push(chunk.get("output_ids"), meta)
                    finish = finish_reason_of(meta)
                    if new:
                        yield TokenChunk(tuple(new))
        except httpx.HTTPError as e:
            raise SGLangError(f"sglang at {self.cfg.base_url} stopped answering after {len(asm.tokens)} tokens: "
                              f"{type(e).__name__}: {e}") from e
        if finish is None:
            raise SGLangError(f"the stream from sglang ended after {len(asm.tokens)} tokens without a finish reason")
        return meta, finish

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    # ---- hot swap --------------------------------------------------------------------------------
    def swap_head(self, version: str) -> SwapResult:
        """Serve `version`'s head from the next request on (see the module docstring). "none" is refused: an
        EAGLE-3 server cannot turn drafting off without a restart on other arguments."""
        t0 = time.perf_counter()
        keep = f"{self._version} keeps serving"
        if version == PLAIN or self.registry is None:
            why = "an SGLang EAGLE3 server cannot switch to plain decoding" if version == PLAIN else "no registry"
            return self._refused(version, why, keep, t0)
        with self._swap_lock:
            if version == self._version and self._down is None:
                return SwapResult(True, f"{version} already serving; nothing to do", version, 0.0)
            try:
                new = DraftWeights.read(self.registry.get(version), self.registry.version(version).sha256)
            except Exception as e:  # noqa: BLE001 - missing, checksum, MoE: the old head keeps serving
                return self._refused(version, str(e), keep, t0)
            held = time.perf_counter()  # from here new requests wait
            with self._gate.swap():  # drain: the request in flight finishes first
                drained = time.perf_counter()
                ok, how = self._swap_drained(version, new)
            done = time.perf_counter()
        pause = (done - held) * 1e3
        self.last_swap = {"version": version, "ok": ok, "how": how, "drain_ms": round((drained - held) * 1e3, 1),
                          "pause_ms": round(pause, 1)}
        if not ok:
            return self._refused(version, how, f"{self._version} keeps serving", t0)
        return SwapResult(True, f"head {version} serving on sglang ({how}; new requests waited {pause:.0f} ms); "
                                "watch acceptance", version, (done - t0) * 1e3)

    def _refused(self, version: str, why: str, keep: str, t0: float) -> SwapResult:
        self._count("refused_swaps")
        return SwapResult(False, f"refused {version}: {why}; {keep}", self._version, (time.perf_counter() - t0) * 1e3)

    def _swap_drained(self, version: str, new: DraftWeights) -> tuple[bool, str]:
        """In place when allowed and accepted, else a restart. (ok, what happened or why not)."""
        why = "configured to swap by restart" if self.cfg.swap == "restart" else None
        if why is None and self._down is not None:
            why = f"the server is down ({self._down})"
        if why is None:
            try:
                launched = DraftWeights.read(self.cfg.draft_model_path)
                served = launched if self._served_dir == launched.directory else DraftWeights.read(self._served_dir)
                why = hot_swap_blocker(new, launched)
            except Exception as e:  # noqa: BLE001 - the serving head's files are unreadable: restart instead
                why = f"the serving head's files cannot be read ({e})"
        if why is None:
            ok, why = self._swap_in_place(version, new, served)
            if ok:
                self._count("session_swaps")
                return True, why
        if self.process is None:
            return False, f"{why}, and a restart needs a server this replica launched (sglang.launch: true)"
        error = self._restart(version, new.directory)
        if error is not None:
            return False, f"{why}; the restart failed: {error}"
        self._count("restart_swaps")
        return True, f"restarted on it because {why}"

    def _swap_in_place(self, version: str, new: DraftWeights, served: DraftWeights) -> tuple[bool, str]:
        """One weight-update session, then the checksums. (True, how) or (False, why: restart instead)."""
        session = WeightSession(self.client, self.cfg.tp_size, self.cfg.max_update_bytes)
        touched = False
        try:
            if self._checksums is None:  # the first swap on this server: what it serves now is the reference
                self._checksums = session.checksums()
                self._draft_sums.setdefault(self._label(), self._checksums.draft)
            before, touched = self._checksums, True  # from here the draft may change, whatever happens
            error, touched = session.load(new, version)
            if error is None:
                after = session.checksums()
                error = self._verify(version, before, after, changes=not new.same_weights(served))
                touched = True
        except Exception as e:  # noqa: BLE001 - an answer that is not 0.5.23's, or no answer
            error = f"the weight-update session failed ({type(e).__name__}: {e})"
        if error is None:
            self._checksums, self._draft_sums[version] = after, after.draft
            self._version, self._served_dir = version, new.directory
            return True, "draft weights updated in place; target checksum unchanged, draft checksum changed"
        if touched and self.process is None:  # with a process, the restart onto the new head reloads everything
            self._restore(session, served, before)
        return False, error

    def _verify(self, version: str, before, after, changes: bool) -> Optional[str]:
        if after.target != before.target:
            return "the target's checksum changed during a draft-only update"
        if changes and after.draft == before.draft:
            return "the draft's checksum did not change although the head's weights differ"
        seen = self._draft_sums.get(version)
        if seen is not None and seen != after.draft:
            return f"the draft's checksum differs from the one this server had while serving {version} before"
        return None

    def _restore(self, session: WeightSession, served: DraftWeights, before) -> None:
        """Load the serving head back after a rejected in-place update on a server this replica did not
        launch (one it launched is restarted instead). Marks the server down when the checksums do not come
        back to their values before the update: a changed target must not serve."""
        try:
            error, _ = session.load(served, self._label())
            if error is None and session.checksums() == before:
                return
            why = error or "the checksums did not come back to their values before the update"
        except Exception as e:  # noqa: BLE001 - no answer: the server's state is unknown
            why = f"{type(e).__name__}: {e}"
        self._down = f"a rejected draft update could not be undone ({why}); restart the server"

    def _restart(self, version: str, head_dir: Path) -> Optional[str]:
        """Stop the server and launch it on `head_dir` labelled `version`, then warm it up; None on success.
        When that fails, launch it on the head it served before; `_down` says why when that fails too."""
        new_cfg = self.cfg.model_copy(update={"draft_model_path": str(head_dir), "weight_version": version})
        back_cfg = self.cfg.model_copy(update={"draft_model_path": str(self._served_dir),
                                               "weight_version": self._label()})
        stop_process(self.process)
        self._checksums, self._draft_sums = None, {}  # a new process: checksums are taken afresh
        error = self._start(new_cfg)
        if error is None:
            self._version, self._served_dir, self._down = version, Path(head_dir), None
            return None
        back = self._start(back_cfg)
        self._down = None if back is None else f"restarts on {version} and on {self._label()} failed: {back}"
        return error

    def _label(self) -> str:
        """The --weight-version of the head the draft holds now."""
        return self._version if self._version != PLAIN else self.cfg.head_label

    def _start(self, cfg: SGLangConfig) -> Optional[str]:
        try:
            self.process = launch_sglang(cfg, client=self.client, spawn=self.spawn)
            self.cfg = cfg
            self._warm_up()
            return None
        except Exception as e:  # noqa: BLE001 - reported by the swap that asked for the restart
            stop_process(self.process)
            return f"{type(e).__name__}: {e}"

    def _warm_up(self) -> None:
        """One short greedy request; the restarted server must answer it, labelled with its head."""
        ids = [int(t) for t in self.tokenizer("warm up")["input_ids"]] or [0]
        ep = ENDPOINTS["generate"]
        r = self.client.request(ep.method, ep.path, json=warmup_body(ids, f"warmup-{time.time_ns()}"))
        if r.status_code != 200:
            raise SGLangError(f"the warm-up request got {r.status_code}: {r.text[:200]}")
        meta = r.json().get("meta_info") or {}
        if finish_reason_of(meta) is None:
            raise SGLangProtocolError(f"the warm-up answer has no finish reason: {r.text[:200]}")
        if meta.get("weight_version") != self.cfg.head_label:
            raise SGLangError(f"the restarted server is labelled {meta.get('weight_version')!r}, not "
                              f"{self.cfg.head_label!r}")

    def set_canary(self, version, fraction: float) -> SwapResult:
        """Refused (ending one is a no-op): an SGLang server holds one draft model, so a canary needs a
        second replica (the gateway's fleet then swaps some replicas instead)."""
        if version is None:
            return SwapResult(True, "no canary was running", None)
        return SwapResult(False, f"refused canary {version}: an SGLang server holds one draft head; run at least "
                                 "2 replicas for a canary", None)

    def close(self) -> None:
        self.client.close()
        stop_process(self.process)

    def info(self) -> dict:
        with self._count_lock:
            counts = dict(self.counts)
        return {"backend": self.name, "url": self.cfg.base_url, "head_version": self._version,
                "launch_args": self.cfg.launch_args("python"), "down": self._down, "counts": counts,
                "last_swap": dict(self.last_swap)}
