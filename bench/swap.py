"""Hot swap cost: how long installing a head takes, and how much it stalls requests in flight.

One process, the real SmolLM2-135M target and the shipped heads (v1 and v2 alternate). First a
request decodes undisturbed (its step times are the baseline); then the same request decodes
while another thread installs a head every few steps (`engine.set_head`: validate, prepare off the
decode path, flip). Reports the install time (alone and under decoding), the step time of the
in-flight request away from and during installs, and checks that the swapped request's output is
unchanged (it finishes on the head it started with). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adaptive_eagle.checkpoint import load_head  # noqa: E402
from adaptive_eagle.engine import EngineConfig, SpeculativeEngine  # noqa: E402
from adaptive_eagle.targets import load_target  # noqa: E402
from adaptive_eagle.trace import SamplingParams  # noqa: E402

HEADS = Path(__file__).resolve().parent.parent / "heads"
PROMPT = "Explain how a hash table works and when to use one, in a short paragraph."


def timed_steps(engine, sp, on_step=None) -> tuple[list[float], list[int], str | None]:
    """Per-step wall ms of one streamed request, its tokens and the head version it reported."""
    times, tokens, version = [], [], None
    t = time.perf_counter()
    for i, (new, res) in enumerate(engine.stream(PROMPT, sp, request_id="swap-bench")):
        now = time.perf_counter()
        if res is not None:
            version = res.head_version
            break
        times.append((now - t) * 1e3)
        tokens += new
        if on_step:
            on_step(i)
        t = time.perf_counter()
    return times, tokens, version


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="48 new tokens, 3 installs")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--installs", type=int, default=6)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    if args.quick:
        args.max_new, args.installs = 48, 3
    target = load_target(device=args.device)
    heads = [load_head(HEADS / name, target, device=target.device)
             for name in ("smollm2-135m-english-v2", "smollm2-135m-english-v1")]
    engine = SpeculativeEngine(target, heads[0], EngineConfig())
    sp = SamplingParams(max_tokens=args.max_new)
    engine.generate(PROMPT, sp)  # warm up kernels and the calibration

    alone = []
    for i in range(args.installs):  # install time with nothing decoding
        res = engine.set_head(heads[(i + 1) % 2])
        assert res.ok, res.message
        alone.append(res.install_ms)
    engine.set_head(heads[0])
    base_times, base_tokens, _ = timed_steps(engine, sp)

    # the same request, with installs from another thread every `every` steps
    every = max(2, len(base_times) // (args.installs + 1))
    installing = threading.Event()
    during: set[int] = set()
    loaded_ms: list[float] = []
    threads: list[threading.Thread] = []
    step_now = [0]

    def install(k: int) -> None:
        installing.set()
        res = engine.set_head(heads[k % 2])
        loaded_ms.append(res.install_ms)
        installing.clear()

    def on_step(i: int) -> None:
        step_now[0] = i
        if installing.is_set():
            during.add(i)
        if i and i % every == 0 and len(threads) < args.installs and not installing.is_set():
            th = threading.Thread(target=install, args=(len(threads) + 1,))
            threads.append(th)
            th.start()

    engine.set_head(heads[0])
    swap_times, swap_tokens, version = timed_steps(engine, sp, on_step)
    for th in threads:
        th.join()
    hit = [swap_times[i] for i in sorted(during) if i < len(swap_times)]
    quiet = [t for i, t in enumerate(swap_times) if i not in during]
    figures = {
        "head_install_ms": round(statistics.median(alone), 1),
        "head_install_ms_while_decoding": round(statistics.median(loaded_ms), 1) if loaded_ms else None,
        "step_ms_undisturbed": round(statistics.median(base_times), 1),
        "step_ms_away_from_installs": round(statistics.median(quiet), 1) if quiet else None,
        "step_ms_during_installs_median": round(statistics.median(hit), 1) if hit else None,
        "step_ms_during_installs_max": round(max(hit), 1) if hit else None,
        "installs_during_request": len(threads), "steps_overlapping_installs": len(hit),
        "output_unchanged": swap_tokens == base_tokens, "request_head_version": version,
        "compute": target.compute, "quick": args.quick,
    }
    print(f"target compute {target.compute}; head install alone {figures['head_install_ms']} ms (median of "
          f"{len(alone)}), while decoding {figures['head_install_ms_while_decoding']} ms")
    print(f"in-flight step: {figures['step_ms_undisturbed']} ms undisturbed, {figures['step_ms_away_from_installs']} "
          f"ms away from installs, {figures['step_ms_during_installs_median']} ms median / "
          f"{figures['step_ms_during_installs_max']} ms max during {len(hit)} steps that overlapped an install")
    print(f"swapped request finished on {version}, output unchanged: {figures['output_unchanged']}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
