"""SGLang check (a GPU machine with `adaptive-eagle[sglang]` installed; run by ops/gpu_check.sh).

Serves SmolLM2 through SGLang twice, without drafting and with EAGLE-3 and the shipped head, through this
project's SGLang backend, and checks what only a running server can show, as named steps:
1. launch: SGLang starts with our launch arguments (SGLangConfig.launch_args) and answers /health; its
   /server_info (server_args.resolved_dict() + launch_command: sglang/srt/utils/common.py build_server_info,
   0.5.23) says what it resolved (speculative_algorithm, max_running_requests);
2. greedy: every prompt's output ids with EAGLE-3 equal SGLang's plain decoding, token for token (streamed
   through the backend, so the stream assembly is checked too), and each finished answer's spec_* fields agree
   with one another and carry the head's version;
3. concurrent: `--concurrency` threads (16) stream through SGLangBackend.stream at once: all finish (none
   hangs past its timeout), each output equals the sequential one, and the streams overlap (the replica passes
   concurrency through to SGLang's batching instead of serialising it); the wall time against the sequential
   one is reported;
4. swap: to a copy of the shipped head whose lm_head rows are rolled by one (same config and vocabulary, so it
   loads in place; its drafts are mostly wrong): the target's checksum unchanged, the draft's changed, the
   output unchanged (lossless), the accept length falls; swapping back restores checksum and accept length;
5. swaps in a row: three swaps without requests between them, each in place with the checksums it must
   have; then the server is alive (/health, and an answer equal to plain decoding's).
Writes its results as it goes to `--out DIR/sglang_check.json` (a run cut short by a timeout leaves the steps it
finished), prints a table, and ends with one JSON line; exits 1 when a check fails.
`--preflight` only checks that the installed packages meet sglang's own requirements (importlib.metadata).
Owns: nothing the project imports; a check script.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    import httpx

    from serving.sglang_backend import SGLangConfig

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# the project, httpx and sglang's other needs are imported where they are used: `--preflight` runs on the standard
# library and `packaging` alone, so it can say what a machine lacks before anything else is imported


# ---- the report ---------------------------------------------------------------------------------------------
@dataclass
class Report:
    """The JSON summary, rewritten whole (atomically) after every step, so a run that is killed keeps what it did."""
    path: Optional[Path] = None
    data: dict = field(default_factory=lambda: {"checks": {}, "figures": {}, "notes": []})

    def check(self, name: str, ok: bool) -> bool:
        self.data["checks"][name] = bool(ok)
        self.save()
        return bool(ok)

    def figure(self, **values) -> None:
        self.data["figures"].update(values)
        self.save()

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        self.save()

    @property
    def ok(self) -> bool:
        return bool(self.data["checks"]) and all(self.data["checks"].values())

    def save(self) -> None:
        if self.path is None:
            return
        self.data["ok"] = self.ok
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


# ---- preflight: the installed packages against sglang's own requirements ---------------------------------------
def requirement_problems(requires: list[str], version_of: Callable[[str], Optional[str]]) -> list[str]:
    """Each unconditional requirement (or one whose marker holds here) that the installed version does not meet.
    `requires`: Requires-Dist lines as importlib.metadata.requires gives them; `version_of(name)`: None when
    the package is not installed."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip's own copy
        from pip._vendor.packaging.requirements import Requirement

    problems = []
    for line in requires:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra's, or another platform's
        have = version_of(req.name)
        if have is None:
            problems.append(f"{req.name}{req.specifier}: not installed")
        elif req.specifier and not req.specifier.contains(have, prereleases=True):
            problems.append(f"{req.name}{req.specifier}: {have} installed")
    return problems


def installed_version(name: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def preflight() -> dict:
    """What sglang needs and what is missing here, without importing sglang (nothing starts)."""
    from importlib import metadata

    out = {"python": sys.version.split()[0], "sglang": installed_version("sglang"),
           "torch": installed_version("torch"), "transformers": installed_version("transformers")}
    if out["sglang"] is None:
        out["problems"] = ["sglang: not installed (the image needs adaptive-eagle[sglang])"]
    else:
        out["problems"] = requirement_problems(metadata.requires("sglang") or [], installed_version)
    return out


# ---- talking to a server ------------------------------------------------------------------------------------
def chat_ids(tok, text: str) -> list[int]:
    """Token ids of one user turn with the generation prompt (transformers 5 returns a BatchEncoding)."""
    out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return [int(t) for t in (out["input_ids"] if hasattr(out, "keys") else out)]


def generate(client: httpx.Client, ids: list[int], max_new: int) -> dict:
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": {"temperature": 0.0,
                                                                          "max_new_tokens": max_new}})
    r.raise_for_status()
    return r.json()


def _plain_args(cfg: SGLangConfig) -> list[str]:
    """The same target without drafting: SGLang's own plain decoding."""
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", cfg.model_path, "--host", cfg.host,
            "--port", str(cfg.port), *cfg.extra_args]


def serve_plain(cfg: SGLangConfig, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    import httpx

    from serving.sglang_backend import launch_sglang, stop_process

    proc = launch_sglang(cfg, args=_plain_args(cfg))
    try:
        with httpx.Client(base_url=cfg.base_url, timeout=cfg.timeout_s) as client:
            return [generate(client, ids, max_new)["output_ids"] for ids in prompts]
    finally:
        stop_process(proc, 60)


def server_info(client: httpx.Client) -> dict:
    """The fields of /server_info this check reports (0.5.23: resolved server args + launch_command)."""
    import httpx

    try:
        info = client.get("/server_info").json()
    except (httpx.HTTPError, ValueError) as e:
        return {"error": str(e)}
    return {k: info.get(k) for k in ("version", "speculative_algorithm", "max_running_requests",
                                     "speculative_num_draft_tokens", "launch_command")}


def spec_problems(meta: dict, version: str, draft_tokens: int) -> list[str]:
    """What in one finished answer's meta_info disagrees with the 0.5.23 definitions."""
    problems = []
    if meta.get("weight_version") != version:
        problems.append(f"weight_version {meta.get('weight_version')!r}, expected {version!r}")
    verify, hist = meta.get("spec_verify_ct"), meta.get("spec_correct_drafts_histogram") or []
    if not verify:
        return problems + ["no spec_verify_ct: the request did not decode speculatively"]
    if abs(meta["spec_accept_length"] - meta["completion_tokens"] / verify) > 1e-6:
        problems.append("spec_accept_length != completion_tokens / spec_verify_ct")
    if sum(hist) != verify:
        problems.append(f"histogram counts {sum(hist)} steps, spec_verify_ct {verify}")
    if sum(k * n for k, n in enumerate(hist)) != meta.get("spec_num_correct_drafts"):
        problems.append("histogram-weighted sum != spec_num_correct_drafts")
    if meta.get("spec_num_proposed_drafts") != verify * draft_tokens:
        problems.append("spec_num_proposed_drafts != spec_verify_ct x (num_draft_tokens - 1)")
    return problems


def stream_one(backend, ids: list[int], max_new: int, request_id: str):
    """One request through SGLangBackend.stream: (the finished BackendResult, seconds to its first item)."""
    from serving.messages import DecodeRequest

    req = DecodeRequest(request_id=request_id, prompt=tuple(ids), max_tokens=max_new)
    t0, first, last = time.perf_counter(), None, None
    for item in backend.stream(req, ids, capture=False):
        first = time.perf_counter() - t0 if first is None else first
        last = item
    return last, first


def serve_with(backend, server: Optional[httpx.Client], prompts: list[list[int]], max_new: int, version: str) -> dict:
    """Every prompt through the backend (streamed), one at a time: output ids, accept lengths, metric problems
    (server: the same request again, not streamed, for its meta_info; None skips that)."""
    outs, accepts, problems = [], [], []
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        result, _ = stream_one(backend, ids, max_new, f"{version}-{i}")
        outs.append(list(result.token_ids))
        accepts.append(result.trace.accept_length_mean)
        if server is None:
            continue
        answer = generate(server, ids, max_new)
        if answer["output_ids"] != outs[-1]:
            problems.append(f"prompt {i}: the streamed tokens differ from the non-streamed answer's")
        problems += [f"prompt {i}: {p}" for p in spec_problems(answer["meta_info"], version,
                                                              backend.cfg.num_draft_tokens - 1)]
    return {"outputs": outs, "accept": statistics.mean(accepts), "problems": problems,
            "wall_s": time.perf_counter() - t0}


# ---- concurrency --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ConcurrentRun:
    outputs: tuple  # per request: its output ids, or None when it failed or hung
    errors: tuple[str, ...]  # "request i: why" for each request that raised
    hung: int  # requests still running at the deadline
    wall_s: float
    overlap: int  # the most requests between their first item and their end at one time


def concurrent_streams(backend, prompts: list[list[int]], max_new: int, timeout_s: float) -> ConcurrentRun:
    """Every prompt in a thread of its own, released together, through SGLangBackend.stream at once."""
    n = len(prompts)
    outputs: list = [None] * n
    spans: list = [None] * n
    errors: list[str] = []
    gate = threading.Barrier(n + 1)

    def run(i: int) -> None:
        gate.wait()
        t0 = time.perf_counter()
        try:
            result, first = stream_one(backend, prompts[i], max_new, f"concurrent-{i}")
            outputs[i] = list(result.token_ids)
            spans[i] = (t0 + (first or 0.0), time.perf_counter())
        except Exception as e:  # noqa: BLE001 - counted, reported
            errors.append(f"request {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(i,), daemon=True, name=f"concurrent-{i}") for i in range(n)]
    for t in threads:
        t.start()
    gate.wait()
    t0 = time.perf_counter()
    deadline = t0 + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()))
    wall = time.perf_counter() - t0
    hung = sum(t.is_alive() for t in threads)
    return ConcurrentRun(tuple(outputs), tuple(errors), hung, wall, max_overlap([s for s in spans if s]))


def max_overlap(spans: list[tuple[float, float]]) -> int:
    """The most intervals that hold one instant (an end before a start at the same time)."""
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans], key=lambda e: (e[0], e[1]))
    best = now = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best


# ---- swaps --------------------------------------------------------------------------------------------------
def rolled_copy(registry, version: str) -> str:
    """A copy of `version` whose lm_head rows are rolled by one: same config and d2t, drafts mostly wrong."""
    import torch

    from adaptive_eagle.checkpoint import HeadMeta, load_head

    loaded = load_head(registry.get(version))
    loaded.head.lm_head.weight.data = torch.roll(loaded.head.lm_head.weight.data, 1, 0)
    meta = HeadMeta.new(f"{version}-rolled", loaded.meta.target_name, loaded.meta.target_fingerprint, parent=version)
    return registry.register(loaded.head, meta, dtype=loaded.head.lm_head.weight.dtype)


def swaps_in_a_row(backend, session, versions: list[str], drafts: dict[str, str], target: str) -> list[str]:
    """Swap to each version in turn, no request between: what went wrong (each must go in place, leave the
    target's checksum alone and give the draft the checksum seen before for that version, where one was)."""
    problems = []
    for i, version in enumerate(versions):
        res = backend.swap_head(version)
        if not res.ok or "in place" not in res.message:
            problems.append(f"swap {i + 1} to {version}: {'in place' if res.ok else 'refused'}? {res.message}")
            continue
        sums = session.checksums()
        if sums.target != target:
            problems.append(f"swap {i + 1} to {version}: the target's checksum changed")
        if drafts.get(version, sums.draft) != sums.draft:
            problems.append(f"swap {i + 1} to {version}: the draft's checksum is not the one {version} had")
        drafts.setdefault(version, sums.draft)
    return problems


def alive_problems(client: httpx.Client, ids: list[int], max_new: int, want: list[int]) -> list[str]:
    """The server answers /health and greedy-decodes `ids` to `want`."""
    import httpx

    try:
        if client.get("/health").status_code != 200:
            return ["/health does not answer 200"]
        got = generate(client, ids, max_new)["output_ids"]
    except httpx.HTTPError as e:
        return [f"the server does not answer: {type(e).__name__}: {e}"]
    return [] if got == want else [f"the answer differs from plain decoding from token {first_difference(got, want)}"]


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ---- the steps ----------------------------------------------------------------------------------------------
@dataclass
class Setup:
    tok: object
    prompts: list  # token ids of each prompt
    registry: object
    head: str  # the shipped head's version in a scratch registry
    rolled: str  # its copy with rolled lm_head rows
    cfg: SGLangConfig


def setup(args) -> Setup:
    from transformers import AutoTokenizer

    from adaptive_eagle.cli import SHIPPED_HEAD
    from adaptive_eagle.registry import HeadRegistry
    from serving.sglang_backend import SGLangConfig
    from adaptive_eagle.targets import materialize_builtin
    from trainer import data as D

    model = materialize_builtin("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(model, local_files_only=True)
    texts = D.first_user_messages(D.load_sharegpt(), args.prompts, domains=["english", "code"], split="heldout")
    registry = HeadRegistry.create(Path(tempfile.mkdtemp(prefix="sglang-check-")) / "registry")
    head = registry.add(SHIPPED_HEAD)
    cfg = SGLangConfig(model_path=str(model), draft_model_path=str(registry.get(head)), weight_version=head,
                       port=args.port, launch=True, startup_timeout_s=args.startup_timeout,
                       timeout_s=args.request_timeout, extra_args=tuple(a for s in args.sglang_arg for a in s.split()))
    return Setup(tok, [chat_ids(tok, t) for t in texts], registry, head, rolled_copy(registry, head), cfg)


def step_launch(cfg: SGLangConfig, report: Report):
    """SGLang on our launch arguments: it must answer /health within cfg.startup_timeout_s."""
    import httpx

    from serving.sglang_backend import launch_sglang
    report.figure(launch_args=cfg.launch_args("python"))
    t0 = time.perf_counter()
    try:
        proc = launch_sglang(cfg)
    except (RuntimeError, TimeoutError) as e:
        report.check("launch_with_our_args", False)
        report.note(f"launch: {e}")
        raise
    report.figure(startup_s=round(time.perf_counter() - t0, 1))
    with httpx.Client(base_url=cfg.base_url, timeout=30) as client:
        info = server_info(client)
    report.figure(server_info=info)
    report.check("launch_with_our_args", info.get("speculative_algorithm") in ("EAGLE3", None))
    return proc


def step_greedy(backend, server, s: Setup, plain: list, args, report: Report) -> dict:
    base = serve_with(backend, server, s.prompts, args.max_new, s.head)
    mismatches = [i for i, (a, b) in enumerate(zip(plain, base["outputs"])) if a != b]
    for i, (a, b) in enumerate(zip(plain, base["outputs"])):
        print(f"{i:3d} {'ok' if a == b else f'DIFF at token {first_difference(a, b)}':<18} {len(b):4d} tokens")
    for p in base["problems"][:10]:
        print("metrics:", p)
    report.figure(prompts=len(s.prompts), mismatches=len(mismatches), accept_length=round(base["accept"], 3))
    report.check("greedy_equal", not mismatches)
    report.check("metrics_consistent", not base["problems"])
    return base


def step_concurrent(backend, s: Setup, args, report: Report) -> None:
    batch = [s.prompts[i % len(s.prompts)] for i in range(args.concurrency)]
    sequential = serve_with(backend, None, batch, args.max_new, s.head)
    run = concurrent_streams(backend, batch, args.max_new, args.concurrent_timeout)
    unequal = [i for i, (a, b) in enumerate(zip(run.outputs, sequential["outputs"])) if a is not None and a != b]
    for e in run.errors[:5]:
        print("concurrent:", e)
    report.figure(concurrency=len(batch), concurrent_wall_s=round(run.wall_s, 2),
                  sequential_wall_s=round(sequential["wall_s"], 2), concurrent_overlap=run.overlap,
                  concurrent_speedup=round(sequential["wall_s"] / run.wall_s, 2) if run.wall_s else None,
                  concurrent_errors=len(run.errors), concurrent_hung=run.hung, concurrent_unequal=len(unequal))
    report.check("concurrent_all_finished", run.hung == 0 and not run.errors)
    report.check("concurrent_equal_sequential", not unequal and None not in run.outputs)
    report.check("concurrent_overlapped", run.overlap > len(batch) // 2)


def step_swap(backend, server, session, s: Setup, plain: list, base: dict, args, report: Report) -> dict:
    """Head -> rolled copy -> head, serving each; the draft checksums seen per version."""
    sums0 = session.checksums()
    swap = backend.swap_head(s.rolled)
    sums1 = session.checksums()
    after = serve_with(backend, server, s.prompts, args.max_new, s.rolled) if swap.ok else None
    back = backend.swap_head(s.head)
    sums2 = session.checksums()
    again = serve_with(backend, server, s.prompts, args.max_new, s.head) if back.ok else None
    report.figure(swap=swap.message, swap_back=back.message, swap_ms=round(swap.install_ms, 1),
                  swap_back_ms=round(back.install_ms, 1),
                  accept_length_rolled_head=round(after["accept"], 3) if after else None,
                  accept_length_back=round(again["accept"], 3) if again else None)
    report.check("swap_in_place", swap.ok and "in place" in swap.message)
    report.check("target_unchanged", sums0.target == sums1.target == sums2.target)
    report.check("draft_changed", sums1.draft != sums0.draft)
    report.check("draft_restored", sums2.draft == sums0.draft)
    report.check("lossless_after_swap", after is not None and after["outputs"] == plain)
    report.check("accept_falls_with_rolled_head", after is not None and after["accept"] < base["accept"] - 0.1)
    report.check("accept_restored", again is not None and abs(again["accept"] - base["accept"]) < 0.05)
    report.check("labels_after_swaps", after is not None and again is not None
                 and not after["problems"] + again["problems"])
    return {"target": sums0.target, "drafts": {s.head: sums0.draft, s.rolled: sums1.draft}}


def step_swaps_in_a_row(backend, server, session, s: Setup, plain: list, seen: dict, args, report: Report) -> None:
    problems = swaps_in_a_row(backend, session, [s.rolled, s.head, s.rolled], dict(seen["drafts"]), seen["target"])
    alive = alive_problems(server, s.prompts[0], args.max_new, plain[0])
    for p in problems + alive:
        print("swaps in a row:", p)
    report.figure(swaps_in_a_row_problems=problems + alive)
    report.check("three_swaps_in_a_row", not problems)
    report.check("alive_after_three_swaps", not alive)


def run(args, report: Report) -> None:
    import httpx

    from serving.sglang_backend import SGLangBackend, stop_process
    from serving.sglang_swap import WeightSession

    s = setup(args)
    t0 = time.perf_counter()
    plain = serve_plain(s.cfg, s.prompts, args.max_new)
    report.figure(plain_s=round(time.perf_counter() - t0, 1))
    proc = step_launch(s.cfg, report)
    try:
        backend = SGLangBackend(s.cfg, s.tok, s.registry, s.head, process=proc)
    except BaseException:
        stop_process(proc, 60)
        raise
    try:
        server = httpx.Client(base_url=s.cfg.base_url, timeout=s.cfg.timeout_s)
        session = WeightSession(server)
        base = step_greedy(backend, server, s, plain, args, report)
        step_concurrent(backend, s, args, report)
        seen = step_swap(backend, server, session, s, plain, base, args, report)
        step_swaps_in_a_row(backend, server, session, s, plain, seen, args, report)
    finally:
        backend.close()  # stops the server it runs now (a restart's, if one happened)
    report.check("run_completed", True)


def parse_args(argv: Optional[list[str]] = None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT"), help="write sglang_check.json here (default: $OUT)")
    ap.add_argument("--preflight", action="store_true", help="only check sglang's requirements; start nothing")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16, help="requests streamed through the backend at once")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--startup-timeout", type=float, default=180.0, help="seconds each SGLang launch may take")
    ap.add_argument("--request-timeout", type=float, default=60.0, help="HTTP timeout of one request")
    ap.add_argument("--concurrent-timeout", type=float, default=120.0, help="seconds the concurrent requests get")
    ap.add_argument("--sglang-arg", action="append", default=[], help="one more launch_server argument (repeat)")
    return ap.parse_args(argv)


def _terminated(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks: every SGLang server is stopped


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    if args.preflight:
        found = preflight()
        if out is not None:
            (out / "preflight.json").write_text(json.dumps(found, indent=1))
        print(json.dumps(found))
        return 1 if found["problems"] else 0
    report = Report(out / "sglang_check.json" if out is not None else None)
    signal.signal(signal.SIGTERM, _terminated)
    try:
        run(args, report)
    except BaseException as e:  # noqa: BLE001 - a failed or killed run still reports what it did
        report.note(f"stopped: {type(e).__name__}: {e}")
        report.check("run_completed", False)
        if not isinstance(e, Exception):
            raise
    finally:
        for name, ok in report.data["checks"].items():
            print(f"{'PASS' if ok else 'FAIL'}  {name}")
        print(json.dumps({**report.data, "ok": report.ok}, default=str))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
