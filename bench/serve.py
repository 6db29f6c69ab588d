"""Serving benchmark: throughput and P50/P95 time per output token (TPOT) through the gateway at 1, 4
and 16 concurrent clients (the official openai client, one thread per client), capture off next to
capture at 100% into a local store, in one run on the same target.

Baseline vs subject: the same replica setup twice — capture disabled, and every request captured
with its aux hidden states (`CapturePolicy(fraction=1)`, no byte budget limit) into a local Arrow
store — run at each concurrency level in ABBA order (off, capture, capture, off; half the requests a
run), so slow drift of a shared machine falls on both alike. Prompts (smollm2): distinct held-out
ShareGPT English first turns, the same ones in the same order for both modes, none sent twice to a
gateway (a repeated prompt would be answered from the suffix index of earlier outputs). One replica
(the machine's cores are shared by everything; `--replicas` for more). TPOT is measured at the client (wall time of the
request, queueing included, per output token) and at the server (decode time per token, the
response's `adaptive_eagle.tpot_s`). Requests are streamed, so the client also splits each request into
TTFT (to the first content chunk: the wait for a free replica, prefill and the first step) and decode TPOT
((last chunk - first chunk) / (tokens - 1)). With many clients per replica the first figure is mostly
queueing: at 16 clients a request waits for up to 15 others, and its tail (P95 of a few dozen requests)
is set by which short answers happened to queue last; decode TPOT and TTFT show the two parts apart.
Greedy requests, `--max-tokens` each.

`--backend sglang-standin`: instead, the concurrency sweep of one SGLang replica (serialised vs batched)
against the SGLang stand-in's queueing model; bench/serve_batching.py says what it models.

Same work in both arms: by default the replicas' drafting decisions are pinned (`cost_aware: false`, no
persisted calibration), so the two gateways, fed the same prompts in the same order, draft the same trees,
accept the same tokens and differ only by capture. The engine's default cost-aware tree sizing follows the
measured step times of its own replica, so two replicas drift apart on timing noise (accept length 1.60 on
one, 1.52 on the other over the same 16 prompts), and TPOT then measures that drift rather than capture;
`--cost-aware` runs that default anyway. Besides the P50 ratio the report gives the paired figure: the
median over prompts of capture TPOT / off TPOT for the same prompt.

Targets: `smollm2` (default: the real SmolLM2-135M-Instruct from `load_target()`, the shipped head)
or `tiny` (a random tiny Llama with a word-level tokenizer and a random head: a smoke run).
`--quick`: fewer requests and shorter outputs.
Final line: one JSON object with `capture_tpot_overhead_pct` (client P50 TPOT at concurrency 1,
capture on vs off), `capture_tpot_p95_overhead_pct` (the same at P95; `p95_overhead_pct_by_clients` per
level), `capture_tpot_overhead_paired_pct` (the paired figure at concurrency 1), `failed_requests`, and
every row's figures.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PINNED = {"cost_aware": False, "calibration_dir": ""}  # drafting decisions independent of step timing
TINY = ["w5 w9 w12 w7 w30", "w40 w41 w8", "w11 w22 w33 w44 w55 w6", "w17 w4 w60", "w20 w21 w22 w23",
        "w50 w9 w31 w14"]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


# ---- setups ----------------------------------------------------------------------------------------
def tiny_setup(tmp: Path):
    """A tiny random target with a word tokenizer and a registry holding one random head."""
    import torch

    from adaptive_eagle.checkpoint import HeadMeta
    from adaptive_eagle.draft_head import DraftHeadConfig, Eagle3DraftHead, init_weights
    from adaptive_eagle.registry import HeadRegistry
    from bench.tiny import tiny_chat_target

    target = tiny_chat_target()
    registry = HeadRegistry.create(tmp / "registry")
    cfg = DraftHeadConfig.from_target(target.config, draft_vocab_size=64, aux_layer_ids=target.aux_layer_ids)
    torch.manual_seed(11)
    head = Eagle3DraftHead(cfg)
    init_weights(head, std=0.1)
    head.embed_tokens.weight.data.copy_(target.input_embeddings())
    registry.register(head, HeadMeta.new("tiny-v1", target.name, target.fingerprint), dtype=torch.float32)
    engine = {"cost_aware": False, "prompt_lookup": False, "suffix_drafting": False, "calibration_dir": ""}
    return target, registry, "tiny-v1", TINY, engine


def smollm2_setup(tmp: Path):
    from adaptive_eagle.cli import SHIPPED_HEAD
    from adaptive_eagle.registry import HeadRegistry
    from adaptive_eagle.targets import load_target
    from trainer.data import first_user_messages, load_sharegpt

    target = load_target()
    registry = HeadRegistry.create(tmp / "registry")
    version = registry.add(SHIPPED_HEAD)
    # distinct real prompts: a repeated prompt would be answered from the suffix index of earlier outputs
    prompts = first_user_messages(load_sharegpt(), 400, domains=["english"], split="heldout", max_chars=600)
    return target, registry, version, prompts, dict(PINNED)


def start_gateway(target, registry, version, engine: dict, capture: bool, store_root: Path | None, replicas: int):
    from feature_store.config import StoreConfig
    from serving.capture import CapturePolicy
    from serving.config import EngineParams, ServingConfig
    from serving.gateway import GatewayThread, create_app
    from serving.replicas import build_replicas

    policy = CapturePolicy(enabled=capture, fraction=1.0, budget_bytes_per_s=1e12, seed=0)
    store = StoreConfig(backend="local", local_root=str(store_root)) if capture else None
    config = ServingConfig(model_name="bench", port=0, replicas=replicas, queue_size=256, max_prompt_tokens=1024,
                           max_tokens_limit=1024, default_max_tokens=64, registry_path=str(registry.root),
                           initial_head=version, capture=policy, store=store, engine=EngineParams(**engine))
    servers = build_replicas(config, target_builder=lambda: target)
    thread = GatewayThread(create_app(config, servers))
    return thread, thread.start(), servers


# ---- load ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    wall: float  # seconds from sending to the last chunk (queueing included)
    n: int  # completion tokens
    ae: dict  # the response's adaptive_eagle metrics
    prompt: int  # index into the prompts
    ttft: float  # seconds to the first content chunk: the wait for a replica, prefill, first step
    tpot: float | None  # (last chunk - first chunk) / (n - 1): decoding alone, as the client sees it


def run_level(url: str, prompts: list[str], clients: int, per_client: int, max_tokens: int, offset: int = 0) -> dict:
    """`clients` threads, `per_client` requests each, back to back, prompts from `offset` on: the raw rows,
    failures and wall time."""
    import openai

    lock, rows, failures = threading.Lock(), [], []

    def client(k: int) -> None:
        c = openai.OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600)
        for i in range(per_client):
            p = (offset + k * per_client + i) % len(prompts)
            prompt = prompts[p]
            t0 = time.perf_counter()
            first = last = None
            try:  # streamed: the first token's time splits queueing (TTFT) from decoding (TPOT)
                for chunk in c.chat.completions.create(model="bench", messages=[{"role": "user", "content": prompt}],
                                                       temperature=0, max_tokens=max_tokens, stream=True):
                    if chunk.choices and chunk.choices[0].delta.content and first is None:
                        first = time.perf_counter()
                    last = chunk
            except Exception as e:  # noqa: BLE001 - counted, the run goes on
                with lock:
                    failures.append(f"{type(e).__name__}: {e}")
                continue
            end = time.perf_counter()
            n, ae = last.usage.completion_tokens, last.adaptive_eagle
            first = end if first is None else first
            with lock:
                rows.append(Row(end - t0, n, ae, p, first - t0, (end - first) / (n - 1) if n > 1 else None))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    return {"rows": rows, "failures": failures, "wall_s": time.perf_counter() - t0}


def summarise(runs: list[dict]) -> dict:
    """One mode's figures at one level, pooled over its runs."""
    rows = [r for run in runs for r in run["rows"]]
    failures = [f for run in runs for f in run["failures"]]
    wall = sum(run["wall_s"] for run in runs)
    tokens = sum(r.n for r in rows)
    client_tpot = [r.wall / r.n for r in rows if r.n]
    server_tpot = [r.ae["tpot_s"] for r in rows if r.n]
    ttft = [r.ttft for r in rows]
    decode_tpot = [r.tpot for r in rows if r.tpot is not None]
    return {"requests": len(rows), "failed": len(failures), "tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 2) if wall > 0 else 0.0,
            "client_tpot_p50_ms": round(1e3 * pct(client_tpot, 0.5), 2),
            "client_tpot_p95_ms": round(1e3 * pct(client_tpot, 0.95), 2),
            "server_tpot_p50_ms": round(1e3 * pct(server_tpot, 0.5), 2),
            "server_tpot_p95_ms": round(1e3 * pct(server_tpot, 0.95), 2),
            "ttft_p50_ms": round(1e3 * pct(ttft, 0.5), 2), "ttft_p95_ms": round(1e3 * pct(ttft, 0.95), 2),
            "decode_tpot_p50_ms": round(1e3 * pct(decode_tpot, 0.5), 2),
            "decode_tpot_p95_ms": round(1e3 * pct(decode_tpot, 0.95), 2),
            "accept_length": round(statistics.fmean(r.ae["accept_length"] for r in rows), 3) if rows else None,
            "captured": sorted({r.ae["captured"] for r in rows}), "errors": failures[:3],
            "tpot_by_prompt": {r.prompt: r.wall / r.n for r in rows if r.n}}


def paired_overhead_pct(off: dict, on: dict) -> float | None:
    """Median over prompts served in both modes of (capture TPOT / off TPOT) - 1, in percent."""
    common = sorted(set(off["tpot_by_prompt"]) & set(on["tpot_by_prompt"]))
    if not common:
        return None
    return round(100 * (statistics.median(on["tpot_by_prompt"][p] / off["tpot_by_prompt"][p] for p in common) - 1), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=("smollm2", "tiny"), default="smollm2")
    ap.add_argument("--quick", action="store_true", help="fewer requests, shorter outputs")
    ap.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts")
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default 8 quick, 32 full)")
    ap.add_argument("--max-tokens", type=int, default=None, help="output tokens per request (default 32 / 128)")
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--cost-aware", action="store_true",
                    help="the engine's default timing-driven tree sizing (the arms then draft differently)")
    ap.add_argument("--backend", choices=("reference", "sglang-standin"), default="reference",
                    help="sglang-standin: the concurrency sweep of one SGLang replica, serialised vs batched, "
                         "against the SGLang stand-in's queueing model (bench/serve_batching.py; default levels "
                         "1,4,16,48)")
    ap.add_argument("--step-ms", type=float, default=20.0, help="sglang-standin: a verify step's time at batch 1")
    ap.add_argument("--batch-cost", type=float, default=0.01,
                    help="sglang-standin: a step's slow-down per extra running request (0.01 = +1%%)")
    args = ap.parse_args()
    if args.backend == "sglang-standin":
        from bench.serve_batching import run

        tmp = Path(tempfile.mkdtemp(prefix="bench-serve-"))
        try:
            return run(args, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    per_level = args.requests or (8 if args.quick else 32)
    max_tokens = args.max_tokens or (32 if args.quick else 128)
    tmp = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    target, registry, version, prompts, engine = (tiny_setup if args.target == "tiny" else smollm2_setup)(tmp)
    if args.cost_aware:
        engine = {k: v for k, v in engine.items() if k not in PINNED}
    gateways = {mode: start_gateway(target, registry, version, engine, mode == "capture", tmp / "store", args.replicas)
                for mode in ("off", "capture")}
    results = []
    try:
        used = 2
        for mode, (_, url, _) in gateways.items():  # warm-up: cost model, caches (the same 2 prompts)
            run_level(url, prompts, 1, 2, max_tokens)
        for clients in levels:
            # ABBA: off, capture, capture, off - drift of a noisy machine hits both modes alike
            # each gateway gets the same prompts in the same order, none of them seen before
            half = max(1, per_level // clients // 2)
            runs = {"off": [], "capture": []}
            for k, mode in enumerate(("off", "capture", "capture", "off")):
                offset = used + (0 if k in (0, 1) else half * clients)
                runs[mode].append(run_level(gateways[mode][1], prompts, clients, half, max_tokens, offset))
            used += 2 * half * clients
            for mode in ("off", "capture"):
                row = summarise(runs[mode])
                results.append({"capture": mode, "clients": clients, **row})
                row.pop("tpot_by_prompt")
                print(f"  {mode:8s} c={clients:<3d} {row['requests']:3d} req  {row['tokens_per_s']:8.1f} tok/s  "
                      f"client TPOT P50 {row['client_tpot_p50_ms']:7.2f} P95 {row['client_tpot_p95_ms']:7.2f} ms  "
                      f"server P50 {row['server_tpot_p50_ms']:7.2f} ms  decode TPOT P95 "
                      f"{row['decode_tpot_p95_ms']:7.2f} ms  TTFT P95 {row['ttft_p95_ms']:8.1f} ms  failed "
                      f"{row['failed']}", flush=True)
        stored = gateways["capture"][2][0].status().store or {}
    finally:
        for thread, _, servers in gateways.values():
            thread.stop()
            for s in servers:
                s.close()
        shutil.rmtree(tmp, ignore_errors=True)
    report(results, levels, args, stored)


def report(results: list[dict], levels: list[int], args, stored: dict) -> None:
    by = {(r["capture"], r["clients"]): r for r in results}
    overhead, overhead_p95, paired = {}, {}, {}
    drafting = "cost-aware (timing-driven) trees" if args.cost_aware else "pinned drafting decisions"
    print(f"\nserving benchmark ({args.target}, {'quick' if args.quick else 'full'}, {drafting}): capture off vs 100% "
          "(local store)")
    print(f"{'clients':>7} | {'tok/s off':>9} {'tok/s cap':>9} | {'P50 off':>8} {'P50 cap':>8} {'P95 off':>8} "
          f"{'P95 cap':>8} (client TPOT, ms) | {'accept off':>10} {'accept cap':>10} | {'P50 ovh':>8} {'P95 ovh':>8} "
          f"{'paired':>7}")
    for c in levels:
        off, on = by[("off", c)], by[("capture", c)]
        overhead[c] = round(100 * (on["client_tpot_p50_ms"] / off["client_tpot_p50_ms"] - 1), 2)
        overhead_p95[c] = round(100 * (on["client_tpot_p95_ms"] / off["client_tpot_p95_ms"] - 1), 2)
        paired[c] = paired_overhead_pct(off, on)
        print(f"{c:>7} | {off['tokens_per_s']:>9.1f} {on['tokens_per_s']:>9.1f} | {off['client_tpot_p50_ms']:>8.2f} "
              f"{on['client_tpot_p50_ms']:>8.2f} {off['client_tpot_p95_ms']:>8.2f} {on['client_tpot_p95_ms']:>8.2f}"
              f"                   | {off['accept_length']!s:>10} {on['accept_length']!s:>10} | {overhead[c]:>7.2f}% "
              f"{overhead_p95[c]:>7.2f}% {paired[c]!s:>6}%")
    decode_p95, ttft_p95 = {}, {}
    print(f"\n{'clients':>7} | {'decode TPOT P95 off':>19} {'cap':>7} {'ovh':>7} | {'TTFT P95 off':>12} "
          f"{'cap':>9} (ms)")
    for c in levels:
        off, on = by[("off", c)], by[("capture", c)]
        decode_p95[c] = round(100 * (on["decode_tpot_p95_ms"] / off["decode_tpot_p95_ms"] - 1), 2)
        ttft_p95[c] = {"off": off["ttft_p95_ms"], "capture": on["ttft_p95_ms"]}
        print(f"{c:>7} | {off['decode_tpot_p95_ms']:>19.2f} {on['decode_tpot_p95_ms']:>7.2f} {decode_p95[c]:>6.2f}% | "
              f"{off['ttft_p95_ms']:>12.1f} {on['ttft_p95_ms']:>9.1f}")
    failed = sum(r["failed"] for r in results)
    print(f"store: {stored.get('written', 0)} records written, {stored.get('dropped', 0)} dropped; "
          f"failed requests: {failed}")
    first = 1 if 1 in overhead else levels[0]
    print(json.dumps({"capture_tpot_overhead_pct": overhead[first], "capture_tpot_overhead_paired_pct": paired[first],
                      "capture_tpot_p95_overhead_pct": overhead_p95[first],
                      "p95_overhead_pct_by_clients": {str(c): v for c, v in overhead_p95.items()},
                      "decode_tpot_p95_overhead_pct_by_clients": {str(c): v for c, v in decode_p95.items()},
                      "ttft_p95_ms_by_clients": {str(c): v for c, v in ttft_p95.items()},
                      "failed_requests": failed, "target": args.target, "quick": args.quick,
                      "cost_aware": args.cost_aware,
                      "overhead_pct_by_clients": {str(c): v for c, v in overhead.items()},
                      "paired_overhead_pct_by_clients": {str(c): v for c, v in paired.items()},
                      "store_written": stored.get("written", 0), "store_dropped": stored.get("dropped", 0),
                      "rows": [{k: v for k, v in r.items() if k not in ("errors", "tpot_by_prompt")} for r in results]}))


if __name__ == "__main__":
    main()
