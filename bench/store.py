"""Feature-store benchmark: codec bytes per token and error, ingest (records/s, MB/s) on loopback
Redis and the local backend, the caller-side latency of put() and, with `--acceptance HEAD_DIR`, the
effect of each codec on a trained head's held-out acceptance.

Baseline vs subject in one run: bf16 (baseline codec) vs the default codec, on both backends.
Shapes are SmolLM2's: aux hidden = 3 x 576 floats per token; values are Gaussian rows with
per-row scales and a few large outlier channels (synthetic, realistic scale).
Acceptance (optional): the real SmolLM2 target's aux features of N held-out English conversations
(8 with --quick, else 24), passed through each codec (encode -> decode, rows as schema.py stores them)
and scored by `trainer.offline.evaluate` (exact target argmax) against the uncompressed features.
Final line: one JSON object (put_p99_ms, default_codec_bytes_ratio, redis_ingest_mb_s, ...; with
--acceptance also default_codec_accept_length_loss, the relative accept-length loss of the default codec).
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
from feature_store.codecs import BASELINE_CODEC, CODECS, DEFAULT_CODEC, get_codec, reconstruction_error  # noqa: E402
from feature_store.config import StoreConfig  # noqa: E402
from feature_store.schema import encode_record  # noqa: E402
from feature_store.writer import StoreWriter  # noqa: E402

N_AUX, HIDDEN = 3, 576
ACCEPT_MAX_LEN, ACCEPT_BATCH_TOKENS = 512, 4096


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


def codec_round_trip(aux, lengths, codec: str, n_aux: int):
    """aux [B, T, n_aux * H] -> (the same features after encode -> decode through `codec`, in aux's dtype;
    bytes; squared error; squared norm). Each sequence's real positions are encoded as [T * n_aux, H]
    rows, as schema.py stores them; padding is left as it is."""
    import torch

    c, out = get_codec(codec), aux.clone()
    nbytes, err2, norm2 = 0, 0.0, 0.0
    for b in range(aux.shape[0]):
        n = int(lengths[b])
        x = aux[b, :n].detach().float().cpu().numpy().reshape(n * n_aux, -1)  # [n * n_aux, H]
        buf = c.encode(x)
        y = torch.from_numpy(c.decode(buf, *x.shape).reshape(n, -1)).to(aux.dtype)  # [n, n_aux * H]
        out[b, :n] = y.to(aux.device)
        d = y.double().numpy().reshape(x.shape) - x
        nbytes += len(buf)
        err2, norm2 = err2 + float((d * d).sum()), norm2 + float((x.astype(np.float64) ** 2).sum())
    return out, nbytes, err2, norm2


def acceptance(head_dir: str, n_convs: int) -> dict:
    """Held-out accept length and alpha[0] of the head at head_dir per codec, on the real SmolLM2 features."""
    import dataclasses

    from adaptive_eagle.checkpoint import load_head
    from adaptive_eagle.targets import load_target
    from trainer.offline import TrainHeadConfig, evaluate, exact_batches
    from trainer.train_head import load_examples

    target = load_target()
    head = load_head(head_dir, target).head.float()
    # the first n_convs usable ones (load_examples drops conversations with under 16 assistant tokens)
    exs = load_examples(TrainHeadConfig(max_len=ACCEPT_MAX_LEN), target, "heldout", ["english"], limit=4 * n_convs)
    exs = exs[:n_convs]
    exact = exact_batches(target, head, exs, ACCEPT_MAX_LEN, ACCEPT_BATCH_TOKENS)
    n_aux, tokens = len(target.aux_layer_ids), int(sum(int(b.lengths.sum()) for b in exact))
    rows = {"uncompressed": {**evaluate(head, target, None, cached=exact), "bytes_per_token": None, "rel_rms": 0.0}}
    scored: dict[str, dict] = {}  # X and X-zstd decode to the same features (zstd is lossless): score once
    for name in sorted(CODECS):
        trips = [codec_round_trip(b.aux, b.lengths, name, n_aux) for b in exact]
        key = name.removesuffix("-zstd")
        if key not in scored:
            cached = [dataclasses.replace(b, aux=t[0]) for b, t in zip(exact, trips)]
            scored[key] = evaluate(head, target, None, cached=cached)
        rows[name] = {**scored[key], "bytes_per_token": sum(t[1] for t in trips) / tokens,
                      "rel_rms": (sum(t[2] for t in trips) / sum(t[3] for t in trips)) ** 0.5}
    return {"rows": rows, "conversations": len(exs), "tokens": tokens}


def report_acceptance(acc: dict) -> dict:
    """Print the per-codec acceptance table; returns the fields it adds to the final JSON line."""
    rows = acc["rows"]
    ref, bf16 = rows["uncompressed"]["accept_length"], rows[BASELINE_CODEC]["accept_length"]
    bf16_bytes = rows[BASELINE_CODEC]["bytes_per_token"]
    print(f"\nacceptance: {acc['conversations']} held-out English conversations, {acc['tokens']} tokens, real SmolLM2 "
          "features through each codec (loss = relative accept-length drop; bar for the default: <= 1%)")
    print(f"{'codec':14s} {'B/token':>8s} {'vs bf16':>8s} {'rel RMS':>9s} {'alpha0':>7s} {'accept len':>10s} "
          f"{'loss':>8s} {'vs bf16':>8s}")
    losses = {}
    for name, r in rows.items():
        losses[name] = (ref - r["accept_length"]) / ref
        size = ("" if r["bytes_per_token"] is None else
                f"{r['bytes_per_token']:8.0f} {r['bytes_per_token'] / bf16_bytes:8.3f}")
        mark = " (default)" if name == DEFAULT_CODEC else ""
        print(f"{name:14s} {size:>17s} {r['rel_rms']:9.2e} {r['alpha'][0]:7.4f} {r['accept_length']:10.4f} "
              f"{losses[name]:8.3%} {(bf16 - r['accept_length']) / bf16:8.3%}{mark}")
    return {"default_codec_accept_length_loss": round(losses[DEFAULT_CODEC], 5),
            "accept_length": {k: round(r["accept_length"], 4) for k, r in rows.items()},
            "real_bytes_ratio": {k: round(r["bytes_per_token"] / bf16_bytes, 4)
                                 for k, r in rows.items() if r["bytes_per_token"] is not None},
            "acceptance_conversations": acc["conversations"]}


def report_codecs(records: list[TraceRecord], tokens: int) -> dict:
    """Print size and error per codec on one synthetic record; returns {codec: CodecError}."""
    print(f"codecs on one record of {tokens} tokens x 3 x {HIDDEN} (bytes per token, error vs float32)")
    rep = reconstruction_error(records[0].aux_hidden.reshape(tokens * N_AUX, HIDDEN))
    print(f"{'codec':12s} {'B/token':>9s} {'vs bf16':>8s} {'rel RMS':>9s} {'max abs':>9s}")
    for r in rep:
        print(f"{r.codec:12s} {r.bytes / tokens:9.0f} {r.bytes_ratio_vs_bf16:8.3f} {r.rel_rms:9.2e} {r.max_abs:9.3f}")
    return {r.codec: r for r in rep}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short run (under a minute)")
    ap.add_argument("--acceptance", metavar="HEAD_DIR", default=None,
                    help="also measure each codec's effect on this head's held-out acceptance (default: skip)")
    args = ap.parse_args()
    n, tokens = (120, 256) if args.quick else (1000, 512)
    records = make_records(n, tokens)

    by = report_codecs(records, tokens)

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
    extra = {}
    if args.acceptance:
        extra = {**report_acceptance(acceptance(args.acceptance, 8 if args.quick else 24)),
                 "acceptance_head": args.acceptance}
    print(json.dumps({
        "put_p99_ms": round(max(m["put_p99_ms"] for *_, m in rows), 4),
        "default_codec": DEFAULT_CODEC,
        "default_codec_bytes_ratio": round(by[DEFAULT_CODEC].bytes_ratio_vs_bf16, 4),
        "default_codec_rel_rms": float(f"{by[DEFAULT_CODEC].rel_rms:.3e}"),
        "bytes_per_token": {name: round(r.bytes / tokens, 1) for name, r in by.items()},
        "redis_ingest_mb_s": round(sub_r["mb_s"], 2), "redis_ingest_records_s": round(sub_r["records_s"], 1),
        "redis_bf16_ingest_mb_s": round(get[("redis", BASELINE_CODEC)]["mb_s"], 2),
        "local_ingest_mb_s": round(sub_l["mb_s"], 2), "local_ingest_records_s": round(sub_l["records_s"], 1),
        "local_bf16_ingest_mb_s": round(get[("local", BASELINE_CODEC)]["mb_s"], 2),
        "dropped": sum(m["dropped"] for *_, m in rows), "records": n, "tokens_per_record": tokens, **extra,
    }))


if __name__ == "__main__":
    main()
