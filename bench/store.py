"""Feature-store benchmark: codec bytes per token and error, ingest (records/s, MB/s) on loopback
Redis and the local backend, and the caller-side latency of put().

Baseline vs subject in one run: bf16 (baseline codec) vs the default codec, on both backends.
Shapes are SmolLM2's: aux hidden = 3 x 576 floats per token; values are Gaussian rows with
per-row scales and a few large outlier channels (synthetic, realistic scale).
Final line: one JSON object (put_p99_ms, default_codec_bytes_ratio, redis_ingest_mb_s, ...).
Starts its own redis-server unless ADAPTIVE_EAGLE_TEST_REDIS_URL is set.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adaptive_eagle.trace import TraceRecord, VerifyStep  # noqa: E402
from feature_store.codecs import BASELINE_CODEC, DEFAULT_CODEC, reconstruction_error  # noqa: E402
from feature_store.config import StoreConfig  # noqa: E402
from feature_store.schema import encode_record  # noqa: E402
from feature_store.writer import StoreWriter  # noqa: E402

N_AUX, HIDDEN = 3, 576


def aux_rows(tokens: int, rng: np.random.Generator) -> np.ndarray:  # [tokens, 3 * 576]
    x = rng.standard_normal((tokens, N_AUX, HIDDEN)).astype(np.float32)
    x *= np.array([0.6, 2.0, 6.0], np.float32)[None, :, None] * rng.uniform(0.7, 1.4, (tokens, 1, 1)).astype(np.float32)
    x[:, :, [5, 131, 402]] *= 30.0  # massive-activation channels
    return x.reshape(tokens, N_AUX * HIDDEN)


def make_records(n: int, tokens: int, seed: int = 0) -> list[TraceRecord]:
    rng = np.random.default_rng(seed)
    prompt = tokens // 3
    return [TraceRecord(
        request_id=f"bench-{i}", target_fingerprint="smollm2-135m", head_version="v1", backend="reference",
        input_ids=tuple(int(t) for t in rng.integers(0, 49152, tokens)),
        loss_mask=(0,) * prompt + (1,) * (tokens - prompt),
        steps=tuple(VerifyStep(8, int(a), int(a)) for a in rng.integers(0, 5, (tokens - prompt) // 3)),
        domain="english", aux_hidden=aux_rows(tokens, rng), aux_layer_ids=(2, 15, 27)) for i in range(n)]


def start_redis() -> tuple[str, subprocess.Popen | None]:
    url = os.environ.get("ADAPTIVE_EAGLE_TEST_REDIS_URL")
    if url:
        return url, None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = tempfile.mkdtemp(prefix="bench-redis-")
    p = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", d, "--save", "",
                          "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return f"redis://127.0.0.1:{port}/0", p


def ingest(cfg: StoreConfig, records: list[TraceRecord], payload_bytes: int) -> dict:
    """put() every record as fast as a server would (caller timing), then wait for the flush."""
    w = StoreWriter(cfg)
    lat = np.empty(len(records))
    t0 = time.perf_counter()
    for i, r in enumerate(records):
        a = time.perf_counter()
        w.put(r)
        lat[i] = time.perf_counter() - a
    w.flush(600)
    wall = time.perf_counter() - t0
    w.close()
    s = w.stats()
    return {"records_s": s.written / wall, "mb_s": s.written * payload_bytes / wall / 1e6,
            "put_p50_ms": float(np.percentile(lat, 50) * 1e3), "put_p99_ms": float(np.percentile(lat, 99) * 1e3),
            "put_max_ms": float(lat.max() * 1e3), "written": s.written, "dropped": s.dropped}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short run (under a minute)")
    args = ap.parse_args()
    n, tokens = (120, 256) if args.quick else (1000, 512)
    records = make_records(n, tokens)

    print(f"codecs on one record of {tokens} tokens x 3 x {HIDDEN} (bytes per token, error vs float32)")
    x = records[0].aux_hidden.reshape(tokens * N_AUX, HIDDEN)
    rep = reconstruction_error(x)
    print(f"{'codec':12s} {'B/token':>9s} {'vs bf16':>8s} {'rel RMS':>9s} {'max abs':>9s}")
    for r in rep:
        print(f"{r.codec:12s} {r.bytes / tokens:9.0f} {r.bytes_ratio_vs_bf16:8.3f} {r.rel_rms:9.2e} {r.max_abs:9.3f}")
    by = {r.codec: r for r in rep}

    url, proc = start_redis()
    tmp = Path(tempfile.mkdtemp(prefix="bench-store-"))
    rows = []
    try:
        for backend in ("redis", "local"):
            for codec in (BASELINE_CODEC, DEFAULT_CODEC):
                cfg = StoreConfig(backend=backend, codec=codec, redis_url=url, key_prefix=f"bench{time.time_ns()}",
                                  local_root=str(tmp / f"{backend}-{codec}"), spill_dir=str(tmp / "spill"),
                                  spill_threshold_bytes=8 << 20, queue_max_records=n, queue_max_bytes=4 << 30)
                payload = len(encode_record(records[0], codec))
                rows.append((backend, codec, payload, ingest(cfg, records, payload)))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\ningest: {n} records of {tokens} tokens with hidden states (payload = one Arrow IPC record)")
    print(f"{'backend':8s} {'codec':10s} {'payload KB':>10s} {'records/s':>10s} {'MB/s':>8s} {'put p50 ms':>11s} "
          f"{'put p99 ms':>11s} {'put max ms':>11s} {'dropped':>8s}")
    for backend, codec, payload, m in rows:
        print(f"{backend:8s} {codec:10s} {payload / 1e3:10.1f} {m['records_s']:10.1f} {m['mb_s']:8.1f} "
              f"{m['put_p50_ms']:11.4f} {m['put_p99_ms']:11.4f} {m['put_max_ms']:11.3f} {m['dropped']:8d}")
    get = {(b, c): m for b, c, _, m in rows}
    sub_r, sub_l = get[("redis", DEFAULT_CODEC)], get[("local", DEFAULT_CODEC)]
    print(json.dumps({
        "put_p99_ms": round(max(m["put_p99_ms"] for *_, m in rows), 4),
        "default_codec": DEFAULT_CODEC,
        "default_codec_bytes_ratio": round(by[DEFAULT_CODEC].bytes_ratio_vs_bf16, 4),
        "default_codec_rel_rms": float(f"{by[DEFAULT_CODEC].rel_rms:.3e}"),
        "bytes_per_token": {r.codec: round(r.bytes / tokens, 1) for r in rep},
        "redis_ingest_mb_s": round(sub_r["mb_s"], 2), "redis_ingest_records_s": round(sub_r["records_s"], 1),
        "redis_bf16_ingest_mb_s": round(get[("redis", BASELINE_CODEC)]["mb_s"], 2),
        "local_ingest_mb_s": round(sub_l["mb_s"], 2), "local_ingest_records_s": round(sub_l["records_s"], 1),
        "local_bf16_ingest_mb_s": round(get[("local", BASELINE_CODEC)]["mb_s"], 2),
        "dropped": sum(m["dropped"] for *_, m in rows), "records": n, "tokens_per_record": tokens,
    }))


if __name__ == "__main__":
    main()
