"""TEST CODE, not a server: an in-process stand-in for one SGLang 0.5.23 server, written from the 0.5.23
source (read from its wheel; see tests/serving/sglang_upstream.py), so the SGLang backend's whole path can
run without a GPU: launch arguments, streamed /generate with meta_info, the weight-update session, the
per-selector checksums and a process that can be stopped, restarted, or die.

What it imitates, with where upstream does it:
- Arguments are parsed like `sglang.launch_server`'s (`--weight-version` labels every answer, "default"
  without it; `--incremental-streaming-output` switches output_ids from all tokens so far to new tokens).
- /generate streams `data: {"text", "output_ids", "meta_info"}` chunks and `data: [DONE]`; every chunk's
  meta_info has `completion_tokens` (all tokens so far) and `weight_version`; the finished one has the
  finish reason and the canonical spec_* fields (tokenizer_manager._calculate_spec_decoding_metrics).
  An abort is a finished chunk with `finish_reason {"type": "abort", "message", "status_code"}`.
- The weight update is a session (scheduler weight_updater): /update_weights_from_tensor outside
  /begin_weight_update .. /end_weight_update is refused. Payloads are never deserialised here (the
  project never unpickles): the stand-in reads the tensors the backend built each payload from (recorded
  where `serving.sglang_protocol.named_tensor_payload` builds it, below), and a payload it did not see built
  is refused; test_sglang_contract.py checks the payload's globals against upstream's allow-list by reading
  its opcodes without running them;
  the draft's loader skips unknown names silently; a draft update that carries `d2t` kills the server, as
  0.5.23's does (the runner moves every tensor to the GPU, LlamaForCausalLMEagle3.load_weights adds a CPU
  `torch.arange` to it, nothing catches the RuntimeError and the scheduler SIGQUITs its parent): the
  update's connection drops and the server is gone. The worker's vocabulary map is the launch head's.
  A draft head sent with the "target" (or "all") selector hits the target's loader, which refuses a
  tensor whose shape differs from its parameter of that name. Each update waits for streams in flight.
- /weights_checker answers per selector with per-tensor checksums, draft names prefixed by the role.
- Batching (scheduler): up to `--max-running-requests` requests decode at once (48 when the flag is not
  given: speculative_hook._handle_eagle_family sets it for EAGLE-3), the rest wait in SGLang's queue. The
  queueing model a bench can turn on (`step_s`, `batch_cost`): every verify step of a request takes
  step_s * (1 + batch_cost * (running - 1)), so a batch of b requests commits b tokens-per-step in about the
  time of one, slowed by batch_cost per extra request (a GPU's decode is memory-bound at small batches).

Where it is stricter than upstream, on purpose: any request field or sampling parameter it does not
implement is refused (upstream ignores unknown request fields silently), and the contract tests check
that everything it implements exists upstream.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import threading
import time

import httpx
import torch

import serving.sglang_protocol as protocol
from serving.sglang_swap import WEIGHTS_FILE

# the fields this stand-in implements, per path (tests/serving/test_sglang_contract.py: all exist upstream)
FIELDS = {
    "/generate": {"rid", "input_ids", "sampling_params", "stream"},
    "/begin_weight_update": {"selector"},
    "/update_weights_from_tensor": {"serialized_named_tensors", "selector", "flush_cache", "weight_version",
                                    "load_format", "abort_all_requests"},
    "/end_weight_update": set(),
    "/weights_checker": {"action", "selector"},
}
SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "max_new_tokens", "sampling_seed", "stop", "json_schema", "ebnf"}
CONSTRAINTS = ("json_schema", "regex", "ebnf", "structural_tag")  # SamplingParams.verify: at most one
SELECTORS = ("target", "draft", "all")
EAGLE_MAX_RUNNING_REQUESTS = 48  # speculative_hook._handle_eagle_family, when --max-running-requests is unset
# the globals an update payload may use (a subset of upstream's allow-list) and the one upstream redirects to
# a weights-only load; test_sglang_contract.py reads them from the payload's opcodes and checks both
ALLOWED_GLOBALS = {("torch._utils", "_rebuild_tensor_v2"), ("collections", "OrderedDict")}
REDIRECTED = ("torch.storage", "_load_from_bytes")

# payload -> the named tensors it was built from, recorded as the backend builds each one: the stand-in reads
# an update's tensors from here instead of deserialising the payload
_BUILT: dict[str, list] = {}
_build_payload = protocol.named_tensor_payload


def _recording_payload(tensors: dict) -> str:
    payload = _build_payload(tensors)
    if len(_BUILT) > 256:
        _BUILT.clear()
    _BUILT[payload] = [(name, t.detach().to("cpu").clone()) for name, t in tensors.items()]
    return payload


protocol.named_tensor_payload = _recording_payload  # tensor_update_bodies builds every payload through it


def _tensors_of(payload: str) -> list | None:
    """The named tensors a payload was built from; None for a payload the backend did not build."""
    base64.b64decode(payload, validate=True)  # upstream's first step: a malformed payload fails here too
    return _BUILT.get(payload)


def parse_launch_args(args: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sglang.launch_server (stand-in)", exit_on_error=False)
    for flag in ("--model-path", "--host", "--speculative-algorithm", "--speculative-draft-model-path"):
        p.add_argument(flag, required=flag != "--host")
    for flag in ("--port", "--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--incremental-streaming-output", action="store_true")
    i = args.index("sglang.launch_server") + 1 if "sglang.launch_server" in args else 0
    return p.parse_args(args[i:])


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


class _ReadersWriter:
    """Streams read, weight updates write: an update waits for the streams in flight; new streams wait for it."""

    def __init__(self) -> None:
        self._cond, self._readers, self._writing = threading.Condition(), 0, False

    def read(self):
        with self._cond:
            self._cond.wait_for(lambda: not self._writing)
            self._readers += 1

    def done_reading(self):
        with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    def write(self):
        with self._cond:
            self._cond.wait_for(lambda: not self._writing)
            self._writing = True
            self._cond.wait_for(lambda: self._readers == 0)

    def done_writing(self):
        with self._cond:
            self._writing = False
            self._cond.notify_all()


class SGLangStandIn:
    """One stand-in server, built from its launch arguments. Faults a test can set: `abort` (message,
    status_code) for the next request, `error_chunk` (message, code), `die_after` (chunks, then the
    connection drops and the server is gone), `ignore_draft_updates` (success, nothing loaded: names the
    loader skips), `touch_target` (a draft update also changes a target tensor)."""

    def __init__(self, args: list[str]) -> None:
        from safetensors.torch import load_file

        a = parse_launch_args(args)
        if a.speculative_algorithm != "EAGLE3":
            raise ValueError(f"the stand-in serves EAGLE3 only, not {a.speculative_algorithm}")
        self.args, self.alive = a, True
        self.label, self.incremental, self.tp_size = a.weight_version, a.incremental_streaming_output, a.tp_size
        self.num_steps, self.num_draft_tokens = a.speculative_num_steps, a.speculative_num_draft_tokens
        saved = load_file(f"{a.speculative_draft_model_path}/{WEIGHTS_FILE}")
        self.draft = {k.replace("midlayer.", "layers.0."): v for k, v in saved.items() if k not in ("d2t", "t2d")}
        self.serving_d2t = saved["d2t"]  # the worker's map is taken once, at launch
        self.vocab, hidden = int(saved["t2d"].numel()), int(self.draft["norm.weight"].numel())
        g = torch.Generator().manual_seed(int(hashlib.sha256(a.model_path.encode()).hexdigest()[:8], 16))
        self.target = {"model.embed_tokens.weight": torch.randn(self.vocab, hidden, generator=g),
                       "model.norm.weight": torch.ones(hidden), "lm_head.weight": torch.randn(self.vocab, hidden,
                                                                                              generator=g)}
        self.session = None
        self.lock = _ReadersWriter()
        self.log: list[tuple[str, str, dict]] = []
        self.abort = self.error_chunk = self.die_after = None
        self.ignore_draft_updates = self.touch_target = False
        # batching: a scheduler slot per running request (EAGLE-3's default is 48), the queueing model's costs
        self.max_running = a.max_running_requests or EAGLE_MAX_RUNNING_REQUESTS
        self.step_s, self.batch_cost = 0.0, 0.0
        self._sched = threading.Condition()
        self.running = self.peak_running = 0

    # ---- the model: the target decides every token, the draft only how many are accepted per step -------
    def next_token(self, ids: list[int]) -> int:
        return (31 * sum(ids) + 7 * len(ids)) % (self.vocab - 4) + 4

    def accepted_per_step(self) -> int:
        return int(self.checksum("draft")["per_engine_checksum"][:8], 16) % (self.num_steps + 1)

    # ---- HTTP ----------------------------------------------------------------------------------------
    def handle(self, request: httpx.Request) -> httpx.Response:
        if not self.alive:
            raise httpx.ConnectError("connection refused (the stand-in server is not running)", request=request)
        path = request.url.path
        body = json.loads(request.content) if request.content else {}
        self.log.append((request.method, path, body))
        if path == "/health":
            return httpx.Response(200)
        if path not in FIELDS:
            return httpx.Response(404, json={"detail": "Not Found"})
        unknown = sorted(set(body) - FIELDS[path])
        if unknown:
            return self._refuse(path, f"unknown field `{unknown[0]}` (the stand-in implements "
                                      f"{sorted(FIELDS[path])})", 422)
        if path == "/generate":
            return self.generate(body)
        return getattr(self, path.strip("/"))(body)

    @staticmethod
    def _refuse(path: str, message: str, status: int = 400) -> httpx.Response:
        if path == "/generate":
            return httpx.Response(status, json={"error": message})
        return httpx.Response(status, json={"success": False, "message": message})

    def generate(self, body: dict) -> httpx.Response:
        sp = body.get("sampling_params") or {}
        if bad := sorted(set(sp) - SAMPLING_FIELDS):
            return self._refuse("/generate", f"unknown field `{bad[0]}`")
        if sum(sp.get(k) is not None for k in CONSTRAINTS) > 1:
            return self._refuse("/generate", "Only one of json_schema, regex, ebnf, or structural_tag can be set.")
        body = dict(body, _grammar_abort=self._grammar_abort(sp))
        if not body.get("stream"):
            last = None
            for chunk in self._chunks(body, sp, incremental=False):
                last = chunk
            return httpx.Response(200, json=last)
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=self._sse(body, sp))

    @staticmethod
    def _grammar_abort(sp: dict):
        """Compile the request's constraint as the xgrammar backend's dispatch_json / dispatch_ebnf would (the
        grammar alone: the stand-in's word vocabulary is no tokenizer xgrammar could mask); a grammar that does
        not compile aborts the request with status 400 (grammar_manager: set_finish_with_abort). The stand-in's
        tokens are a hash of the prompt and never follow the grammar: what it checks is what SGLang is sent."""
        import xgrammar as xgr

        for key, build in (("json_schema", xgr.Grammar.from_json_schema), ("ebnf", xgr.Grammar.from_ebnf)):
            if sp.get(key) is not None:
                try:
                    build(sp[key])
                except Exception as e:  # noqa: BLE001 - upstream catches RuntimeError and friends alike
                    return (f"Failed to compile {'json' if key == 'json_schema' else key} grammar: {e}", 400)
        return None

    def _sse(self, body, sp):
        """The request holds the read side of the update lock and a running slot from its first chunk until its
        last one is produced (a client may stop reading there)."""
        self.lock.read()
        self._admit()
        held = [True]

        def release():  # the request leaves the batch and the lock (once)
            if held.pop() if held else False:
                self._leave()
                self.lock.done_reading()

        try:
            for n, chunk in enumerate(self._chunks(body, sp, incremental=self.incremental)):
                self._step()
                if self.die_after is not None and n >= self.die_after:
                    self.alive = False
                    release()
                    raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")
                if "error" in chunk or chunk["meta_info"]["finish_reason"] is not None:
                    release()
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            release()

    # ---- the scheduler's batch ----------------------------------------------------------------------
    def _admit(self) -> None:
        """Wait for a running slot (SGLang queues what exceeds max_running_requests)."""
        with self._sched:
            self._sched.wait_for(lambda: self.running < self.max_running)
            self.running += 1
            self.peak_running = max(self.peak_running, self.running)

    def _leave(self) -> None:
        with self._sched:
            self.running -= 1
            self._sched.notify_all()

    def _step(self) -> None:
        if self.step_s > 0:
            time.sleep(self.step_s * (1 + self.batch_cost * (max(self.running, 1) - 1)))

    def _chunks(self, body: dict, sp: dict, incremental: bool):
        prompt, n = list(body["input_ids"]), int(sp.get("max_new_tokens", 128))
        out, verify, correct, hist = [], 0, 0, []
        k = self.accepted_per_step()
        steps = [1]  # the first token comes from the prefill, then one verify step per chunk
        while sum(steps) < n:
            steps.append(min(k + 1, n - sum(steps)))
        for i, commit in enumerate(steps):
            new = []
            for _ in range(commit):
                new.append(self.next_token(prompt + out))
                out.append(new[-1])
            if i:
                verify, correct = verify + 1, correct + commit - 1
                hist += [0] * (commit - len(hist))
                hist[commit - 1] += 1
            meta = {"id": body.get("rid"), "finish_reason": None, "prompt_tokens": len(prompt),
                    "weight_version": self.label, "completion_tokens": len(out), "cached_tokens": 0}
            if self.error_chunk is not None and i == 1:
                message, code = self.error_chunk
                yield {"error": {"message": message, "type": "invalid_request_error", "code": code}}
                return
            last = i == len(steps) - 1
            if body["_grammar_abort"] is not None:  # aborted before it was scheduled: no token
                message, status = body["_grammar_abort"]
                yield {"text": "", "output_ids": [], "meta_info": dict(meta, completion_tokens=0, finish_reason={
                    "type": "abort", "message": message, "status_code": status, "err_type": "BadRequestError"})}
                return
            if self.abort is not None and (last or i == 1):
                message, status = self.abort
                meta["finish_reason"] = {"type": "abort", "message": message, "status_code": status, "err_type": None}
            elif last:
                meta["finish_reason"] = {"type": "length", "length": n}
                meta["weight_versions"] = [{"version": self.label, "start": 0, "end": len(out)}]
                if verify:
                    proposed = verify * (self.num_draft_tokens - 1)
                    meta.update(spec_accept_rate=correct / proposed, spec_accept_length=len(out) / verify,
                                spec_num_correct_drafts=correct, spec_num_proposed_drafts=proposed,
                                spec_verify_ct=verify, spec_correct_drafts_histogram=list(hist))
            yield {"text": "", "output_ids": new if incremental else list(out), "meta_info": meta}
            if meta["finish_reason"] is not None:
                return

    # ---- weight updates ------------------------------------------------------------------------------------
    def begin_weight_update(self, body: dict) -> httpx.Response:
        selector = body.get("selector", "all")
        if selector not in SELECTORS:
            return self._refuse("", f"invalid selector {selector!r}")
        self.lock.write()
        try:
            if self.session is not None:
                return self._refuse("", "a weight-update session is already open; call end_weight_update() first")
            self.session = selector
            return httpx.Response(200, json={"success": True, "message": "Success"})
        finally:
            self.lock.done_writing()

    def end_weight_update(self, body: dict) -> httpx.Response:
        self.lock.write()
        try:
            if self.session is None:
                return self._refuse("", "no weight-update session is open; call begin_weight_update() first")
            self.session = None
            return httpx.Response(200, json={"success": True, "message": "Success"})
        finally:
            self.lock.done_writing()

    def update_weights_from_tensor(self, body: dict) -> httpx.Response:
        selector = body.get("selector", "all")
        if selector not in SELECTORS or not isinstance(body.get("flush_cache", True), bool):
            return self._refuse("", f"invalid selector {selector!r} or flush_cache")
        payloads = body.get("serialized_named_tensors")
        if not isinstance(payloads, list) or len(payloads) < self.tp_size:
            return self._refuse("", f"serialized_named_tensors needs one entry per rank ({self.tp_size})", 422)
        self.lock.write()
        try:
            if self.session is None:
                return self._refuse("", "update_weights_from_tensor must run between begin_weight_update() and "
                                        "end_weight_update()")
            named = [_tensors_of(p) for p in payloads]
            if any(n is None for n in named):
                return self._refuse("", "serialized_named_tensors: a payload the backend did not build (the stand-in "
                                        "does not deserialise payloads)")
            why = self._load(named[0], selector)
            if why is not None:
                return self._refuse("", why)
            if body.get("weight_version") is not None:
                self.label = body["weight_version"]
            return httpx.Response(200, json={"success": True, "message": "Success"})
        finally:
            self.lock.done_writing()

    def _load(self, named: list, selector: str):
        if selector in ("target", "all"):
            for name, t in named:
                if name in self.target and self.target[name].shape != t.shape:
                    return f"target parameter {name}: shape {tuple(self.target[name].shape)}, got {tuple(t.shape)}"
            for name, t in named:
                if name in self.target:
                    self.target[name] = t.to(self.target[name].dtype).clone()
        if selector in ("draft", "all") and not self.ignore_draft_updates:
            for name, t in named:
                name = name.replace("midlayer.", "layers.0.")
                if "d2t" in name:  # upstream: hot_token_id = loaded_weight (on the GPU) + torch.arange(n) (CPU)
                    self.alive = False  # RuntimeError -> the scheduler SIGQUITs the server; the answer never comes
                    raise httpx.RemoteProtocolError("Server disconnected without sending a response. (the stand-in "
                                                    "died as SGLang 0.5.23 does on a d2t in a draft update)")
                if name in self.draft:
                    if self.draft[name].shape != t.shape:
                        return f"draft parameter {name}: shape {tuple(self.draft[name].shape)}, got {tuple(t.shape)}"
                    self.draft[name] = t.to(self.draft[name].dtype).clone()
            if self.touch_target:
                self.target["model.norm.weight"] = self.target["model.norm.weight"] + 1
        return None

    def weights_checker(self, body: dict) -> httpx.Response:
        if body.get("action", "checksum") != "checksum":
            return self._refuse("", f"the stand-in implements action 'checksum' only, not {body.get('action')!r}")
        return httpx.Response(200, json=self.checksum(body.get("selector", "all")))

    def checksum(self, selector: str) -> dict:
        sums = {}
        if selector in ("target", "all"):
            sums.update({k: _digest(t) for k, t in self.target.items()})
        if selector in ("draft", "all"):
            sums.update({f"draft.{k}": _digest(t) for k, t in self.draft.items()})
        h = hashlib.sha256()
        for name in sorted(sums):
            h.update(name.encode() + sums[name].encode())
        per_gpu = h.hexdigest()
        return {"success": True, "message": "Success.",
                "per_engine_checksum": hashlib.sha256(per_gpu.encode()).hexdigest(),
                "ranks": [{"checksums": sums, "per_gpu_checksum": per_gpu, "parallelism_info": []}]}


class StandInProcess:
    """What `subprocess.Popen(launch args)` returns, for a stand-in server."""

    def __init__(self, server: SGLangStandIn | None, returncode=None) -> None:
        self.server, self.returncode = server, returncode

    def poll(self):
        return self.returncode

    def terminate(self) -> None:
        if self.server is not None:
            self.server.alive = False
        self.returncode = -15

    def kill(self) -> None:
        self.terminate()

    def wait(self, timeout=None):
        return self.returncode


class StandInHost:
    """The replica's machine: `spawn(args)` starts a stand-in server as launch_sglang would start
    sglang.launch_server, `transport` reaches whichever server runs now. `failing_launches`: how many of
    the next spawns exit at once (a server that cannot start)."""

    def __init__(self) -> None:
        self.server: SGLangStandIn | None = None
        self.launches: list[list[str]] = []
        self.failing_launches = 0
        self.log: list[tuple[str, str, dict]] = []  # every request, across restarts
        self.transport = httpx.MockTransport(self._handle)

    def spawn(self, args: list[str]) -> StandInProcess:
        self.launches.append(list(args))
        if self.failing_launches:
            self.failing_launches -= 1
            return StandInProcess(None, returncode=1)
        self.server = SGLangStandIn(args)
        return StandInProcess(self.server)

    def client(self) -> httpx.Client:
        return httpx.Client(transport=self.transport, base_url="http://sglang")

    def _handle(self, request: httpx.Request) -> httpx.Response:
        if self.server is None:
            raise httpx.ConnectError("connection refused (no stand-in server started)", request=request)
        response = self.server.handle(request)
        self.log.append(self.server.log[-1])
        return response


class WordTokenizer:
    """Just enough of a Hugging Face tokenizer for the backend: "w5 w9" <-> [5, 9]."""

    def __call__(self, text: str) -> dict:
        return {"input_ids": [int(w[1:]) if w[1:].isdigit() else 3 for w in text.split()]}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return self(" ".join(m["content"] for m in messages))

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(f"w{i}" for i in ids)


def make_registry(root):
    """A registry of three tiny float32 heads for one tiny target (vocabulary 64): v1 and v2 share a draft
    vocabulary of 40 tokens, v3 has another one of the same size (so only a restart can serve it)."""
    from adaptive_eagle.checkpoint import HeadMeta
    from adaptive_eagle.draft_head import DraftHeadConfig, Eagle3DraftHead, init_weights
    from adaptive_eagle.registry import HeadRegistry
    from adaptive_eagle.targets import tiny_target

    target = tiny_target(seed=5, vocab_size=64, hidden_size=32, num_layers=4)
    registry = HeadRegistry.create(root)
    vocabularies = {"v1": torch.arange(4, 44), "v2": torch.arange(4, 44), "v3": torch.arange(24, 64)}
    for i, (version, vocab) in enumerate(vocabularies.items()):
        torch.manual_seed(100 + i)
        cfg = DraftHeadConfig.from_target(target.config, draft_vocab_size=40, aux_layer_ids=target.aux_layer_ids)
        head = Eagle3DraftHead(cfg)
        init_weights(head, std=0.1)
        head.set_draft_vocab(vocab)
        registry.register(head, HeadMeta.new(version, target.name, target.fingerprint), dtype=torch.float32)
    return registry
