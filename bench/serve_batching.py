"""Concurrency sweep of one SGLang replica through the gateway, against the SGLang stand-in's queueing model
(`bench/serve.py --backend sglang-standin` runs it; tests/serving/sglang_standin.py is test code, not SGLang).

Baseline vs subject, side by side at each concurrency level, in one run: the same replica serialised
(`max_inflight: 1`, what a replica did before it passed concurrency through) and batched (the default,
what SGLang runs at once: 48 for EAGLE-3). Clients are the official openai client, one thread each, streaming
greedy chat requests through the real gateway, router, DecodeServer and SGLangBackend over HTTP semantics;
only the server behind them is the stand-in. Its model of SGLang's continuous batching: up to
max_running_requests requests decode at once, each verify step takes step_s * (1 + batch_cost * (running - 1)).
The defaults (20 ms a step, +1% per extra request) are assumptions that shape a GPU's memory-bound decode, not
a measurement of one: the figures say what the replica's concurrency does to a batching server's queue, and
the GPU check (ops/gpu_check.sh) measures SGLang itself where a GPU is lent.

Final line: a JSON object with, per level, both arms' tokens/s, P50/P95 client TPOT and TTFT, the stand-in's
peak running requests, and `throughput_ratio` (batched / serialised).
"""

from __future__ import annotations

import json
import time

PROMPTS = [" ".join(f"w{5 + (7 * i + j) % 50}" for j in range(3 + i % 5)) for i in range(64)]


def start(max_inflight, step_s: float, batch_cost: float, tmp):
    """A gateway over one SGLang replica on a stand-in server; (gateway thread, url, host, server)."""
    from serving.config import ServingConfig
    from serving.gateway import GatewayThread, create_app
    from serving.server import DecodeServer
    from serving.sglang_backend import SGLangBackend, SGLangConfig, launch_sglang
    from tests.serving.sglang_standin import StandInHost, WordTokenizer, make_registry

    registry = make_registry(tmp / f"registry-{max_inflight}")
    sg = SGLangConfig(model_path="/models/tiny", draft_model_path=str(registry.get("v1")), weight_version="v1",
                      launch=True, health_poll_s=0.001, startup_timeout_s=5.0, max_inflight=max_inflight)
    host = StandInHost()
    client = host.client()
    process = launch_sglang(sg, client=client, spawn=host.spawn)
    host.server.step_s, host.server.batch_cost = step_s, batch_cost
    backend = SGLangBackend(sg, WordTokenizer(), registry, "v1", "fp", client=client, process=process,
                            spawn=host.spawn)
    server = DecodeServer(backend, name="sglang-0")
    config = ServingConfig(model_name="bench", port=0, replicas=1, queue_size=1024, max_tokens_limit=1024,
                           default_max_tokens=64, backend="sglang", sglang=sg, request_timeout_s=600)
    thread = GatewayThread(create_app(config, [server]))
    return thread, thread.start(), host, server


def sweep(levels: list[int], per_level: int, max_tokens: int, step_s: float, batch_cost: float, tmp) -> dict:
    from bench.serve import run_level, summarise

    out = {"levels": {}, "model": {"step_s": step_s, "batch_cost": batch_cost}}
    arms = {"serialised": 1, "batched": None}
    gateways = {arm: start(limit, step_s, batch_cost, tmp) for arm, limit in arms.items()}
    try:
        for clients in levels:
            per_client = max(1, per_level // clients)
            level = {}
            for arm, (_, url, host, _) in gateways.items():
                host.server.peak_running = 0
                row = summarise([run_level(url, PROMPTS, clients, per_client, max_tokens)])
                row.pop("tpot_by_prompt")
                level[arm] = {**row, "peak_running": host.server.peak_running}
                print(f"  {arm:10s} c={clients:<3d} {row['requests']:3d} req  {row['tokens_per_s']:8.1f} tok/s  "
                      f"client TPOT P50 {row['client_tpot_p50_ms']:7.2f} P95 {row['client_tpot_p95_ms']:7.2f} ms  "
                      f"TTFT P95 {row['ttft_p95_ms']:8.1f} ms  running at once {host.server.peak_running:3d}  "
                      f"failed {row['failed']}", flush=True)
            base = level["serialised"]["tokens_per_s"]
            level["throughput_ratio"] = round(level["batched"]["tokens_per_s"] / base, 2) if base else None
            out["levels"][str(clients)] = level
    finally:
        for thread, _, _, server in gateways.values():
            thread.stop()
            server.close()
    return out


def run(args, tmp) -> None:
    levels = [int(c) for c in (args.concurrency if args.concurrency != "1,4,16" else "1,4,16,48").split(",")]
    per_level = args.requests or (48 if args.quick else 192)
    max_tokens = args.max_tokens or (24 if args.quick else 64)
    print(f"SGLang replica, serialised vs batched, against the stand-in's queueing model (step {args.step_ms:g} ms, "
          f"+{100 * args.batch_cost:g}% a step per extra running request); {per_level} requests a level, "
          f"{max_tokens} tokens each")
    t0 = time.perf_counter()
    result = sweep(levels, per_level, max_tokens, args.step_ms / 1e3, args.batch_cost, tmp)
    print(f"\n  {'clients':>7s}  {'serialised tok/s':>16s}  {'batched tok/s':>13s}  {'ratio':>5s}  "
          f"{'P95 TPOT ser/bat ms':>20s}")
    for clients, level in result["levels"].items():
        s, b = level["serialised"], level["batched"]
        print(f"  {clients:>7s}  {s['tokens_per_s']:16.1f}  {b['tokens_per_s']:13.1f}  {level['throughput_ratio']:5.2f}  "
              f"{s['client_tpot_p95_ms']:9.1f}/{b['client_tpot_p95_ms']:<9.1f}")
    failed = sum(level[a]["failed"] for level in result["levels"].values() for a in ("serialised", "batched"))
    print(json.dumps({"bench": "serve", "backend": "sglang-standin", "failed_requests": failed,
                      "wall_s": round(time.perf_counter() - t0, 1),
                      "throughput_ratio_by_clients": {c: v["throughput_ratio"] for c, v in result["levels"].items()},
                      **result}))
