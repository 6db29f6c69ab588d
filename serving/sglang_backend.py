"""The SGLang backend (optional extra `adaptive-eagle[sglang]`, GPU only, never installed by CI).

Owns: the `sglang.launch_server` argument list for EAGLE-3 (`SGLangConfig.launch_args`), parsing
per-request acceptance from a response's `meta_info` into a `TraceRecord` (tokens only: SGLang
exposes no aux hidden states, so the trainer regenerates features), streaming `/generate`, and
swapping the draft head through SGLang's weight update from disk with the draft selector. Must not
touch: sglang's Python package (this module talks HTTP; only the marked tests import sglang), the
engine, threads and capture (server.py).

Acceptance fields: `spec_verify_ct` (verify steps), `spec_accept_length` (completion tokens per
verify step, bonus included), `spec_accept_histogram` (read here as: entry k = verify steps that
accepted k draft tokens), `spec_accepted_drafts` / `spec_proposed_drafts`; older versions name the
totals `spec_accept_token_num` / `spec_draft_token_num`. Updating weights with the selector "all"
is known to corrupt a frozen draft silently (accept length 2.7 -> 1.0): the config refuses it.
Unverified on a GPU here: the exact name of the selector field in `/update_weights_from_disk`
(`weight_selector_field`); ops/gpu_check.sh is where it gets confirmed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Iterator, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from adaptive_eagle.binding import SwapResult
from adaptive_eagle.trace import TraceRecord, VerifyStep
from serving.backend import BackendItem, BackendResult, RequestError, TokenChunk, prompt_field
from serving.messages import PLAIN, DecodeRequest


class SGLangConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model_path: str = Field(..., description="target model directory (local)")
    draft_model_path: str = Field(..., description="EAGLE-3 head directory (LlamaForCausalLMEagle3 layout)")
    host: str = Field("127.0.0.1")
    port: int = Field(30000, ge=1, le=65535)
    num_steps: int = Field(5, ge=1, description="--speculative-num-steps (draft depth)")
    eagle_topk: int = Field(4, ge=1, description="--speculative-eagle-topk")
    num_draft_tokens: int = Field(16, ge=1, description="--speculative-num-draft-tokens (tree size)")
    extra_args: tuple[str, ...] = Field((), description="more launch_server arguments, passed as given")
    weight_selector_field: str = Field("target", description="request field of the weight update that selects "
                                       "which model to update")
    weight_selector: Literal["draft"] = Field("draft", description='always "draft": "all" corrupts the draft')
    timeout_s: float = Field(600.0, gt=0, description="HTTP timeout of one request")
    max_prompt_tokens: Optional[int] = Field(None, ge=1)
    launch: bool = Field(False, description="start sglang.launch_server as a child of the replica (stopped when "
                         "the replica closes); False: the server is started separately")
    startup_timeout_s: float = Field(900.0, gt=0, description="wait this long for a launched server's /health")

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def launch_args(self, python: str = sys.executable) -> list[str]:
        return [python, "-m", "sglang.launch_server", "--model-path", self.model_path, "--host", self.host,
                "--port", str(self.port), "--speculative-algorithm", "EAGLE3",
                "--speculative-draft-model-path", self.draft_model_path,
                "--speculative-num-steps", str(self.num_steps), "--speculative-eagle-topk", str(self.eagle_topk),
                "--speculative-num-draft-tokens", str(self.num_draft_tokens), "--enable-metrics",
                *self.extra_args]


def launch_sglang(config: SGLangConfig, client=None, args: Optional[list[str]] = None) -> subprocess.Popen:
    """Start `sglang.launch_server` with `config.launch_args()` (or `args`) and wait until it answers
    /health; raises RuntimeError (the process stopped) or TimeoutError, after stopping it."""
    import httpx

    args = args or config.launch_args()
    proc = subprocess.Popen(args)
    client = client or httpx.Client(base_url=config.base_url, timeout=5.0)
    deadline = time.monotonic() + config.startup_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sglang.launch_server exited with {proc.returncode}: {' '.join(args)}")
        try:
            if client.get("/health").status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(2.0)
    proc.terminate()
    raise TimeoutError(f"sglang did not answer /health at {config.base_url} within {config.startup_timeout_s:g} s")


def _int(meta: dict, *names: str) -> Optional[int]:
    for n in names:
        if meta.get(n) is not None:
            return int(meta[n])
    return None


def verify_steps_from_meta(meta: dict, tree_size: int) -> tuple[VerifyStep, ...]:
    """Per-step records from one finished response's meta_info (exact when a histogram is given;
    otherwise the accepted drafts are spread evenly over the steps, which keeps their sum and mean)."""
    completion = int(meta.get("completion_tokens", 0))
    verify = _int(meta, "spec_verify_ct")
    if not verify:  # not speculative (or nothing decoded): one token per step
        return tuple(VerifyStep(0, 0, 0) for _ in range(completion))
    proposed = _int(meta, "spec_proposed_drafts", "spec_draft_token_num")
    size = max(1, round(proposed / verify)) if proposed else tree_size
    hist = meta.get("spec_accept_histogram")
    if hist:
        counts = [k for k, n in enumerate(hist) for _ in range(int(n))]
    else:
        accepted = _int(meta, "spec_accepted_drafts", "spec_accept_token_num")
        if accepted is None:
            length = meta.get("spec_accept_length")
            accepted = round(float(length) * verify) - verify if length is not None else completion - verify
        accepted = max(0, accepted)
        counts = [accepted // verify + (i < accepted % verify) for i in range(verify)]
    return tuple(VerifyStep(max(size, k), k, k) for k in counts)


def trace_from_response(request: DecodeRequest, prompt_ids: list[int], output_ids: list[int], meta: dict,
                        head_version: str, fingerprint: str, tree_size: int) -> TraceRecord:
    ids = list(prompt_ids) + list(output_ids)
    return TraceRecord(request_id=request.request_id, target_fingerprint=fingerprint,
                       head_version=None if head_version == PLAIN else head_version, backend="sglang",
                       input_ids=tuple(ids), loss_mask=tuple([0] * len(prompt_ids) + [1] * len(output_ids)),
                       steps=verify_steps_from_meta(meta, tree_size), tenant=request.tenant,
                       sampling=request.sampling(), domain=request.domain, capture_consent=request.capture)


def _finish_reason(meta: dict) -> str:
    fr = meta.get("finish_reason")
    kind = fr.get("type") if isinstance(fr, dict) else fr
    return "length" if kind == "length" else "stop"


class SGLangBackend:
    """One SGLang server (started separately: `SGLangConfig.launch_args`). `tokenizer`: the target's
    Hugging Face tokenizer (prompt ids and limits are checked here, before the request is sent)."""

    name = "sglang"

    def __init__(self, config: SGLangConfig, tokenizer, registry=None, head_version: str = PLAIN,
                 fingerprint: str = "", client=None, process: Optional[subprocess.Popen] = None) -> None:
        """process: a server this backend launched (`launch_sglang`); `close` stops it."""
        import httpx

        self.cfg, self.tokenizer, self.registry, self.process = config, tokenizer, registry, process
        self._version, self.fingerprint = head_version, fingerprint
        self.client = client or httpx.Client(base_url=config.base_url, timeout=config.timeout_s)

    @property
    def head_version(self) -> str:
        return self._version

    def prepare(self, request: DecodeRequest) -> list[int]:
        field = prompt_field(request)
        if request.messages is not None:
            out = self.tokenizer.apply_chat_template([dict(m) for m in request.messages], add_generation_prompt=True,
                                                     tokenize=True)
            ids = list(out["input_ids"] if hasattr(out, "keys") else out)
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

    def payload(self, request: DecodeRequest, prompt_ids: list[int]) -> dict:
        sp = {"temperature": request.temperature, "top_p": request.top_p, "max_new_tokens": request.max_tokens}
        if request.top_k:
            sp["top_k"] = request.top_k
        if request.seed is not None:
            sp["sampling_seed"] = request.seed
        return {"input_ids": prompt_ids, "sampling_params": sp, "stream": True, "rid": request.request_id}

    def stream(self, request: DecodeRequest, prompt_ids: list[int], capture: bool) -> Iterator[BackendItem]:
        """Streams /generate; `capture` is ignored (SGLang gives no aux hidden states)."""
        t0 = time.perf_counter()
        out: list[int] = []
        meta: dict = {}
        with self.client.stream("POST", "/generate", json=self.payload(request, prompt_ids)) as resp:
            if resp.status_code != 200:
                resp.read()
                raise RequestError(f"sglang answered {resp.status_code}: {resp.text[:300]}", status=502,
                                   code="backend_error")
            for line in resp.iter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                meta = chunk.get("meta_info", meta)
                ids = chunk.get("output_ids") or []
                new = ids[len(out):] if ids[: len(out)] == out else ids  # cumulative or incremental chunks
                if new:
                    out.extend(int(t) for t in new)
                    yield TokenChunk(tuple(int(t) for t in new))
        trace = trace_from_response(request, prompt_ids, out, {"completion_tokens": len(out), **meta},
                                    meta.get("weight_version") or self._version, self.fingerprint,
                                    self.cfg.num_draft_tokens)
        yield BackendResult(tuple(out), self.decode(out), _finish_reason(meta), trace, time.perf_counter() - t0)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def swap_head(self, version: str) -> SwapResult:
        """Load `version`'s head into the draft model only (never "all"). "none" is refused: an EAGLE3
        server cannot turn drafting off without a restart."""
        t0 = time.perf_counter()
        keep = f"{self._version} keeps serving"
        if version == PLAIN or self.registry is None:
            why = "an SGLang EAGLE3 server cannot switch to plain decoding" if version == PLAIN else "no registry"
            return SwapResult(False, f"refused {version}: {why}; {keep}", self._version, 0.0)
        try:
            path = str(self.registry.get(version))
        except Exception as e:  # noqa: BLE001
            return SwapResult(False, f"refused {version}: {e}; {keep}", self._version, 0.0)
        body = {"model_path": path, "weight_version": version, self.cfg.weight_selector_field: self.cfg.weight_selector}
        try:
            r = self.client.post("/update_weights_from_disk", json=body)
            ans = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
            ok, message = r.status_code == 200 and bool(ans.get("success")), str(ans.get("message", r.text[:300]))
        except Exception as e:  # noqa: BLE001 - the server is unreachable: the old head keeps serving
            ok, message = False, f"{type(e).__name__}: {e}"
        ms = (time.perf_counter() - t0) * 1e3
        if not ok:
            return SwapResult(False, f"refused {version}: sglang: {message}; {keep}", self._version, ms)
        self._version = version
        return SwapResult(True, f"head {version} serving on sglang (draft weights updated); watch acceptance",
                          version, ms)

    def set_canary(self, version, fraction: float) -> SwapResult:
        """Refused (ending one is a no-op): an SGLang server holds one draft model, so a canary needs a
        second replica (the gateway's fleet then swaps some replicas instead)."""
        if version is None:
            return SwapResult(True, "no canary was running", None)
        return SwapResult(False, f"refused canary {version}: an SGLang server holds one draft head; run at least "
                                 "2 replicas for a canary", None)

    def close(self) -> None:
        self.client.close()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def info(self) -> dict:
        return {"backend": self.name, "url": self.cfg.base_url, "head_version": self._version,
                "launch_args": self.cfg.launch_args("python")}
