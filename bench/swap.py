"""Hot swap cost: how long installing a head takes, how much it stalls one engine's request in flight,
and how much a FLEET swap under load stalls the requests in flight.

Part 1, one engine (baseline: a request's undisturbed steps; subject: the same request while another thread
installs a head every few steps with `engine.set_head`: validate, prepare off the decode path, flip).
Reports the install time (alone and under decoding), the step time of the in-flight request away from and
during installs, and checks that the swapped request's output is unchanged (it finishes on the head it
started with).

Part 2, a fleet under load: `--replicas` DecodeServers (in this process, each on its own decode thread)
behind the gateway, `--clients` threads (in a process of their own) streaming chat completions back to
back over HTTP (SSE). The replicas' drafting is pinned (no timing-driven tree sizing, no cross-request
suffix index), so a request's streamed chunks (one per verify step that emitted text) line up one for one
with the same prompt served on the same head without a swap. Reference (baseline): every prompt once on
each head, same load, no swap.
Subject: the same load while `GatewayFleet.swap` (the policy's path) swaps every replica every `--swap-every`
seconds, in a repeating pattern of two promotions and one rollback: a promotion installs a head the replica
does not hold (three heads rotate, so it is loaded from the registry, checked and prepared), a rollback
returns to the head the last swap replaced (held prepared: a flip). The *stall* one swap causes one request in
flight is the largest excess, over the request's gaps between consecutive chunks that overlap the swap call,
of the gap over the same gap in the reference; a sample per (swap, request in flight). Control: the same
figure over placebo windows of the same lengths half-way between two swaps (same phase, same load, nothing
swapping): the measurement's noise floor. A failed request is a non-200 answer, an error event in the
stream, or a stream without its final chunk. Every prompt's text must be the same throughout (lossless
under swaps).

Targets: `smollm2` (the real SmolLM2-135M-Instruct, the shipped heads v1 and v2) or `tiny` (a random tiny
Llama with a word tokenizer and two random heads: a smoke run). `--quick`: a short run.
Ends with one JSON line: the engine figures, `swap_stall_p50_ms` and `swap_stall_p99_ms` (fleet promotions:
requests in flight while a head is loaded and installed), `rollback_stall_p50_ms` / `rollback_stall_p99_ms`
(flips to the head held prepared), `placebo_stall_p50_ms`, `placebo_stall_p99_ms`, `fleet_swap_ms_p50`,
`rollback_ms_p50`, `fleet_swaps`, `failed_requests`, `outputs_unchanged`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adaptive_eagle.engine import EngineConfig, SpeculativeEngine
from adaptive_eagle.trace import SamplingParams

HEADS = Path(__file__).resolve().parent.parent / "heads"
PROMPT = "Explain how a hash table works and when to use one, in a short paragraph."
ENGLISH = ["Give me three tips for writing clear emails.", "Explain what a hash table is to a beginner.",
           "Write a short poem about the sea.", "How do I make a cup of green tea?",
           "What are the benefits of regular exercise?", "Summarise the plot of Romeo and Juliet.",
           "Write a Python function that reverses a string.", "Why is the sky blue?"]
TINY = ["w5 w9 w12 w7 w30", "w40 w41 w8", "w11 w22 w33 w44 w55 w6", "w17 w4 w60", "w20 w21 w22 w23",
        "w50 w9 w31 w14"]
TINY_ENGINE = {"cost_aware": False, "prompt_lookup": False, "suffix_drafting": False, "calibration_dir": ""}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def ms(x: float | None) -> float | None:
    return None if x is None else round(1e3 * x, 1)


# ---- setups ------------------------------------------------------------------------------------------
@dataclass
class Setup:
    target: object
    registry: object  # HeadRegistry holding `versions`
    versions: tuple[str, ...]  # three heads swaps rotate through (the first serves at start)
    prompts: list[str]
    engine: dict  # EngineConfig / EngineParams fields
    prompt: str  # part 1's request


def tiny_setup(tmp: Path) -> Setup:
    """A tiny random target with a word tokenizer and a registry of two random heads."""

    import torch

    from adaptive_eagle.checkpoint import HeadMeta
    from adaptive_eagle.draft_head import DraftHeadConfig, Eagle3DraftHead, init_weights
    from adaptive_eagle.registry import HeadRegistry
    from bench.tiny import tiny_chat_target

    target = tiny_chat_target()
    registry = HeadRegistry.create(tmp / "registry")
    cfg = DraftHeadConfig.from_target(target.config, draft_vocab_size=64, aux_layer_ids=target.aux_layer_ids)
    for version, seed in (("tiny-v1", 11), ("tiny-v2", 12), ("tiny-v3", 13)):
        torch.manual_seed(seed)
        head = Eagle3DraftHead(cfg)
        init_weights(head, std=0.1)
        head.embed_tokens.weight.data.copy_(target.input_embeddings())
        registry.register(head, HeadMeta.new(version, target.name, target.fingerprint), dtype=torch.float32)
    return Setup(target, registry, ("tiny-v1", "tiny-v2", "tiny-v3"), TINY, TINY_ENGINE, TINY[0])


def smollm2_setup(tmp: Path, device: str) -> Setup:
    """The shipped heads v2 and v1, and v1's weights once more under a third version (a promotion must load a
    head the replica does not hold; with two, every swap would return to the one held prepared)."""
    import dataclasses

    from adaptive_eagle.registry import HeadRegistry
    from adaptive_eagle.targets import load_target

    target = load_target(device=device)
    registry = HeadRegistry.create(tmp / "registry")
    versions = [registry.add(HEADS / name) for name in ("smollm2-135m-english-v2", "smollm2-135m-english-v1")]
    v1 = registry.load(versions[1], target)
    versions.append(registry.register(v1.head, dataclasses.replace(v1.meta, version=f"{versions[1]}-copy")))
    return Setup(target, registry, tuple(versions), ENGLISH, {}, PROMPT)


# ---- part 1: one engine ----------------------------------------------------------------------------
def timed_steps(engine, prompt, sp, on_step=None) -> tuple[list[tuple[float, float]], list[int], str | None]:
    """(start, end) perf_counter of every step of one streamed request, its tokens and the head version it
    reported."""
    spans, tokens, version = [], [], None
    t = time.perf_counter()
    for i, (new, res) in enumerate(engine.stream(prompt, sp, request_id="swap-bench")):
        now = time.perf_counter()
        if res is not None:
            version = res.head_version
            break
        spans.append((t, now))
        tokens += new
        if on_step:
            on_step(i)
        t = time.perf_counter()
    return spans, tokens, version


def span_ms(spans: list[tuple[float, float]]) -> list[float]:
    return [(b - a) * 1e3 for a, b in spans]


def engine_swap(setup: Setup, max_new: int, installs: int) -> dict:
    target = setup.target
    heads = [setup.registry.load(v, target, device=target.device) for v in setup.versions]
    engine = SpeculativeEngine(target, heads[0], EngineConfig(**setup.engine))
    sp = SamplingParams(max_tokens=max_new)
    engine.generate(setup.prompt, sp)  # warm up kernels and the calibration

    alone = []
    for i in range(installs):  # install time with nothing decoding
        res = engine.set_head(heads[(i + 1) % 2])
        assert res.ok, res.message
        alone.append(res.install_ms)
    engine.set_head(heads[0])
    base_spans, base_tokens, _ = timed_steps(engine, setup.prompt, sp)
    base_times = span_ms(base_spans)

    # the same request, with installs from another thread every `every` steps
    every = max(2, len(base_times) // (installs + 1))
    windows: list[tuple[float, float]] = []  # (start, end) of every install
    loaded_ms: list[float] = []
    threads: list[threading.Thread] = []

    def install(k: int) -> None:
        t0 = time.perf_counter()
        res = engine.set_head(heads[k % 2])
        windows.append((t0, time.perf_counter()))
        loaded_ms.append(res.install_ms)

    def on_step(i: int) -> None:
        if i and i % every == 0 and len(threads) < installs and not any(th.is_alive() for th in threads):
            th = threading.Thread(target=install, args=(len(threads) + 1,))
            threads.append(th)
            th.start()

    engine.set_head(heads[0])
    swap_spans, swap_tokens, version = timed_steps(engine, setup.prompt, sp, on_step)
    for th in threads:
        th.join()
    overlaps = [any(a < t1 and b > t0 for t0, t1 in windows) for a, b in swap_spans]
    hit = [t for t, o in zip(span_ms(swap_spans), overlaps) if o]
    quiet = [t for t, o in zip(span_ms(swap_spans), overlaps) if not o]
    return {
        "head_install_ms": round(statistics.median(alone), 1),
        "head_install_ms_while_decoding": round(statistics.median(loaded_ms), 1) if loaded_ms else None,
        "step_ms_undisturbed": round(statistics.median(base_times), 1),
        "step_ms_away_from_installs": round(statistics.median(quiet), 1) if quiet else None,
        "step_ms_during_installs_median": round(statistics.median(hit), 1) if hit else None,
        "step_ms_during_installs_max": round(max(hit), 1) if hit else None,
        "installs_during_request": len(threads), "steps_overlapping_installs": len(hit),
        "output_unchanged": swap_tokens == base_tokens, "request_head_version": version,
        "compute": target.compute,
    }


# ---- part 2: a fleet under load --------------------------------------------------------------------
# the fleet's replicas draft the same trees for the same (prompt, head) every time, so a request's steps line up
# one for one with the same request served without a swap: no timing-driven tree sizing, no cross-request suffix
# index (both change a request's steps from one run to the next); the swap path itself is the production one
FLEET_ENGINE = {"cost_aware": False, "suffix_drafting": False, "calibration_dir": ""}


@dataclass(frozen=True)
class Streamed:
    prompt: int
    ok: bool
    text: str
    chunk_times: tuple[float, ...]  # perf_counter of every content chunk (one per verify step that emitted text)
    deltas: tuple[str, ...] = ()  # the content of those chunks
    head_version: str | None = None  # the head the request decoded with (its final chunk says)
    error: str = ""

    @property
    def gaps(self) -> list[tuple[float, float]]:
        """(start, end) of every interval between consecutive chunks."""
        return list(zip(self.chunk_times, self.chunk_times[1:]))


def stream_chat(client, url: str, i: int, prompt: str, max_tokens: int) -> Streamed:
    import httpx

    body = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True}
    text, times, version, final = [], [], None, False
    try:
        with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return Streamed(i, False, "", (), error=f"HTTP {r.status_code}: {r.read()[:200]!r}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Streamed(i, False, "".join(text), tuple(times), error=str(chunk["error"])[:200])
                content = chunk["choices"][0]["delta"].get("content")
                if content:
                    times.append(time.perf_counter())
                    text.append(content)
                if "adaptive_eagle" in chunk:
                    final, version = True, chunk["adaptive_eagle"].get("head_version")
    except httpx.HTTPError as e:
        return Streamed(i, False, "".join(text), tuple(times), error=f"{type(e).__name__}: {e}")
    return Streamed(i, final, "".join(text), tuple(times), tuple(text), version, "" if final else "no final chunk")


def _clients(url: str, prompts: list[str], clients: int, max_tokens: int, stop=None, count: int | None = None
             ) -> list[Streamed]:
    """`clients` threads streaming back to back, prompts in turn, until `stop` is set or `count` requests ran."""
    import httpx

    out, lock, counter = [], threading.Lock(), [0]

    def run() -> None:
        with httpx.Client(timeout=600) as client:
            while not (stop is not None and stop.is_set()):
                with lock:
                    if count is not None and counter[0] >= count:
                        return
                    i, counter[0] = counter[0] % len(prompts), counter[0] + 1
                res = stream_chat(client, url, i, prompts[i], max_tokens)
                with lock:
                    out.append(res)

    threads = [threading.Thread(target=run, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _client_process(url, prompts, clients, max_tokens, stop, count, results) -> None:
    results.put(_clients(url, prompts, clients, max_tokens, stop, count))


def load_phase(url: str, prompts: list[str], clients: int, max_tokens: int, stop: threading.Event | None = None,
               count: int | None = None) -> list[Streamed]:
    """`_clients` in a process of their own, as real clients are: their threads do not compete with the gateway
    and the replicas for this process's interpreter lock. Chunk times are perf_counter readings, the system's
    monotonic clock, so they compare with swap windows taken here."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    child_stop, results = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_client_process, args=(url, prompts, clients, max_tokens, child_stop, count, results),
                       daemon=True)
    proc.start()
    if stop is not None:
        threading.Thread(target=lambda: (stop.wait(), child_stop.set()), daemon=True).start()
    out = results.get()  # (before join: a child blocks on a full pipe until its results are read)
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"the client process exited with {proc.exitcode}")
    return out


def stalls(requests: list[Streamed], reference: dict, windows: list[tuple[float, float]]) -> list[float]:
    """One sample per (window, request in flight during it): how much longer than without a swap the request
    waited for a chunk while the window was open, i.e. the largest (gap - the same gap of the same prompt on
    the same head with no swap) over its gaps that overlap the window. Requests without a reference with the
    same chunks are left out."""
    out = []
    for r in requests:
        ref = reference.get((r.prompt, r.head_version))
        if ref is None or ref.deltas != r.deltas:
            continue
        pairs = list(zip(r.gaps, ref.gaps))
        for t0, t1 in windows:
            excess = [(b - a) - (rb - ra) for (a, b), (ra, rb) in pairs if a < t1 and b > t0]
            if excess:
                out.append(max(excess))
    return out


def schedule(versions: tuple[str, ...], swaps: int) -> list[tuple[str, str]]:
    """(version, kind) of each swap: two promotions (a head the replicas do not hold), then a rollback to the
    head the last promotion replaced; the first version serves at start."""
    current, previous, plan, nxt = versions[0], None, [], 1
    for k in range(swaps):
        if k % 3 == 2:
            version, kind = previous, "rollback"
        else:
            while versions[nxt % len(versions)] in (current, previous):
                nxt += 1
            version, kind = versions[nxt % len(versions)], "promotion"
            nxt += 1
        plan.append((version, kind))
        current, previous = version, current
    return plan


def fleet_swap(setup: Setup, replicas: int, clients: int, max_tokens: int, swaps: int, swap_every_s: float) -> dict:
    from serving.config import EngineParams, ServingConfig
    from serving.gateway import GatewayThread, create_app
    from serving.replicas import build_replicas

    config = ServingConfig(model_name="bench", port=0, replicas=replicas, queue_size=256, max_prompt_tokens=1024,
                           max_tokens_limit=1024, default_max_tokens=max_tokens,
                           registry_path=str(setup.registry.root), initial_head=setup.versions[0],
                           engine=EngineParams(**{**setup.engine, **FLEET_ENGINE}))
    servers = build_replicas(config, target_builder=lambda: setup.target)
    app = create_app(config, servers)
    gateway = GatewayThread(app)
    url = gateway.start(timeout=300)
    fleet = app.state.gateway.fleet
    plan = schedule(setup.versions, swaps)
    windows: dict[str, list[tuple[float, float]]] = {"promotion": [], "rollback": []}
    refused: list[str] = []
    n = len(setup.prompts)
    try:
        load_phase(url, setup.prompts, replicas, max_tokens, count=replicas)  # warm-up
        # the reference: every prompt on each head under the same load, no swap while requests run
        baseline = []
        for version in (*setup.versions[1:], setup.versions[0]):
            assert all(r.ok for r in fleet.swap(version))
            baseline += load_phase(url, setup.prompts, clients, max_tokens, count=n)
        assert all(r.ok for r in fleet.swap(setup.versions[1])) and all(r.ok for r in fleet.swap(setup.versions[0]))
        # (each replica now holds versions[1] prepared, as a replica that served it before would)

        def swapper(stop: threading.Event) -> None:
            for version, kind in plan:
                time.sleep(swap_every_s)
                t0 = time.perf_counter()
                results = fleet.swap(version)
                windows[kind].append((t0, time.perf_counter()))
                refused.extend(r.message for r in results if not r.ok)
                if kind == "rollback" and not all("flip" in r.message for r in results if r.ok):
                    refused.append(f"rollback to {version} loaded it: {[r.message for r in results]}")
            time.sleep(swap_every_s)
            stop.set()

        stop = threading.Event()
        threading.Thread(target=swapper, args=(stop,), daemon=True).start()
        subject = load_phase(url, setup.prompts, clients, max_tokens, stop)
    finally:
        gateway.stop()
        for s in servers:
            s.close()

    reference = {(r.prompt, r.head_version): r for r in baseline if r.ok}
    every = sorted(windows["promotion"] + windows["rollback"])
    # placebo windows: as long as each promotion, half-way between two swaps (the same load, nothing swapping)
    placebo = [(t0 - swap_every_s / 2, t0 - swap_every_s / 2 + (t1 - t0)) for t0, t1 in windows["promotion"]]
    placebo = [(a, b) for a, b in placebo if not any(a < t1 and b > t0 for t0, t1 in every)]
    ok = [r for r in subject if r.ok]
    hit = stalls(ok, reference, windows["promotion"])
    flips = stalls(ok, reference, windows["rollback"])
    quiet = stalls(ok, reference, placebo)
    in_flight = [r for r in ok if any(r.chunk_times and r.chunk_times[0] < t1 and r.chunk_times[-1] > t0
                                      for t0, t1 in every)]
    texts: dict[int, set[str]] = {}
    for r in baseline + subject:
        if r.ok:
            texts.setdefault(r.prompt, set()).add(r.text)
    failed = [r for r in baseline + subject if not r.ok]
    return {"replicas": replicas, "clients": clients, "fleet_swaps": len(every), "swaps_refused": len(refused),
            "fleet_swap_ms_p50": ms(pct([t1 - t0 for t0, t1 in windows["promotion"]], 0.5)),
            "rollback_ms_p50": ms(pct([t1 - t0 for t0, t1 in windows["rollback"]], 0.5)),
            "requests_reference": len(reference), "requests_subject_phase": len(subject),
            "requests_during_swaps": len(in_flight), "samples_promotion": len(hit), "samples_rollback": len(flips),
            "swap_stall_p50_ms": ms(pct(hit, 0.5)), "swap_stall_p99_ms": ms(pct(hit, 0.99)),
            "swap_stall_max_ms": ms(max(hit) if hit else None),
            "rollback_stall_p50_ms": ms(pct(flips, 0.5)), "rollback_stall_p99_ms": ms(pct(flips, 0.99)),
            "placebo_stall_p50_ms": ms(pct(quiet, 0.5)), "placebo_stall_p99_ms": ms(pct(quiet, 0.99)),
            "samples_placebo": len(quiet),
            "failed_requests": len(failed), "errors": [r.error for r in failed[:3]] + refused[:3],
            "outputs_unchanged": all(len(v) == 1 for v in texts.values())}


# ---- main ------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=("smollm2", "tiny"), default="smollm2")
    ap.add_argument("--quick", action="store_true", help="shorter requests, fewer installs and swaps")
    ap.add_argument("--max-new", type=int, default=None, help="new tokens per request (default 128, quick 48)")
    ap.add_argument("--installs", type=int, default=None, help="part 1: installs during one request (6, quick 3)")
    ap.add_argument("--replicas", type=int, default=3, help="part 2: fleet size")
    ap.add_argument("--clients", type=int, default=None, help="part 2: streaming clients (default replicas + 1)")
    ap.add_argument("--swaps", type=int, default=None, help="part 2: fleet swaps (default 45, quick 6)")
    ap.add_argument("--swap-every", type=float, default=None, help="part 2: seconds between swaps (1.5, quick 1)")
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    max_new = args.max_new or (48 if args.quick else 128)
    installs = args.installs or (3 if args.quick else 6)
    swaps = args.swaps or (6 if args.quick else 45)
    swap_every = args.swap_every or (1.0 if args.quick else 1.5)
    clients = args.clients or args.replicas + 1
    tmp = Path(tempfile.mkdtemp(prefix="bench-swap-"))
    try:
        setup = tiny_setup(tmp) if args.target == "tiny" else smollm2_setup(tmp, args.device)
        figures = engine_swap(setup, max_new, installs)
        print(f"target {args.target} ({figures['compute']}); head install alone {figures['head_install_ms']} ms "
              f"(median of {installs}), while decoding {figures['head_install_ms_while_decoding']} ms")
        print(f"in-flight step: {figures['step_ms_undisturbed']} ms undisturbed, "
              f"{figures['step_ms_away_from_installs']} ms away from installs, "
              f"{figures['step_ms_during_installs_median']} ms median / {figures['step_ms_during_installs_max']} ms "
              f"max during {figures['steps_overlapping_installs']} steps that overlapped an install")
        print(f"swapped request finished on {figures['request_head_version']}, output unchanged: "
              f"{figures['output_unchanged']}")
        fleet = fleet_swap(setup, args.replicas, clients, max_new, swaps, swap_every)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nfleet: {fleet['replicas']} replicas, {fleet['clients']} streaming clients, {fleet['fleet_swaps']} swaps "
          f"(promotion median {fleet['fleet_swap_ms_p50']} ms, rollback {fleet['rollback_ms_p50']} ms; "
          f"{fleet['swaps_refused']} refused)")
    print(f"{'stall (gap - same gap unswapped), ms':<38} | {'P50':>7} {'P99':>7} | samples (swap x request)")
    print(f"{'placebo windows (nothing swapping)':<38} | {fleet['placebo_stall_p50_ms']!s:>7} "
          f"{fleet['placebo_stall_p99_ms']!s:>7} | {fleet['samples_placebo']}")
    print(f"{'in flight during a promotion (load)':<38} | {fleet['swap_stall_p50_ms']!s:>7} "
          f"{fleet['swap_stall_p99_ms']!s:>7} | {fleet['samples_promotion']}")
    print(f"{'in flight during a rollback (flip)':<38} | {fleet['rollback_stall_p50_ms']!s:>7} "
          f"{fleet['rollback_stall_p99_ms']!s:>7} | {fleet['samples_rollback']}")
    print(f"requests in flight during swaps: {fleet['requests_during_swaps']} ({fleet['requests_subject_phase']} "
          "in the phase)")
    print(f"failed requests: {fleet['failed_requests']} {fleet['errors'] or ''}; outputs unchanged across swaps: "
          f"{fleet['outputs_unchanged']}")
    print(json.dumps({**figures, **fleet, "target": args.target, "quick": args.quick}))


if __name__ == "__main__":
    main()
