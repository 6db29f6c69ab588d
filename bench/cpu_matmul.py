"""Why the CPU target runs the way it does: matmul and whole-forward cost by rows, per compute mode.

Side by side in one run: bf16 (PyTorch's bf16 GEMM), fp32, and fp32 activations over FBGEMM
fp16-packed weights (adaptive_eagle/cpu_linear.py), first for SmolLM2's weight shapes, then for a
whole SmolLM2-135M forward of q tokens over a 256-token KV cache (q = 1 is plain decoding, q > 1 is
a verify forward). Medians of repeated runs; ratios against bf16 at the same q. Ends with one JSON
line. On CPUs without native bf16 (AVX2) bf16 rows cost ~linearly in q; on AVX512-BF16/AMX they do not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from adaptive_eagle.cpu_linear import Fp16PackedLinear, fbgemm_fp16_available  # noqa: E402
from adaptive_eagle.targets import cpu_has_fast_bf16, load_target  # noqa: E402


def median_ms(fn, n: int) -> float:
    fn()
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs) * 1e3


def matmuls(rows, reps):
    out = {}
    for o, i in [(1536, 576), (576, 1536), (49152, 576)]:
        w = torch.randn(o, i) * 0.02
        lin = torch.nn.Linear(i, o, bias=False)
        lin.weight.data.copy_(w.bfloat16().float())
        packed = Fp16PackedLinear(lin) if fbgemm_fp16_available() else None
        wb = w.bfloat16()
        for m in rows:
            x = torch.randn(m, i)
            xb = x.bfloat16()
            r = {"bf16": median_ms(lambda: F.linear(xb, wb), reps), "fp32": median_ms(lambda: F.linear(x, w), reps)}
            if packed is not None:
                r["fp16-packed"] = median_ms(lambda: packed(x), reps)
            out[f"{o}x{i}@{m}"] = {k: round(v, 4) for k, v in r.items()}
            print(f"  W {o}x{i}, {m:3d} rows: " + "  ".join(f"{k} {v:.3f} ms" for k, v in r.items()), flush=True)
    return out


def forwards(qs, reps, ctx=256):
    from transformers import DynamicCache

    modes = {"bf16": dict(dtype=torch.bfloat16), "fp32": dict(dtype=torch.float32)}
    if fbgemm_fp16_available():
        modes["fp16-packed"] = dict(packed=True)
    res = {}
    for name, kw in modes.items():
        if kw.get("packed"):
            from adaptive_eagle.cpu_linear import pack_linears

            target = load_target(dtype=torch.float32)
            pack_linears(target.model)
        else:
            target = load_target(**kw)
        model = target.model
        ids = torch.randint(100, 40000, (1, ctx + max(qs)))
        with torch.inference_mode():
            cache = DynamicCache()
            model(input_ids=ids[:, :ctx], past_key_values=cache, use_cache=True)
            res[name] = {}
            for q in qs:
                def step():
                    model(input_ids=ids[:, ctx:ctx + q], past_key_values=cache, use_cache=True,
                          position_ids=torch.arange(ctx, ctx + q)[None])
                    for layer in cache.layers:
                        layer.keys, layer.values = layer.keys[..., :ctx, :], layer.values[..., :ctx, :]
                res[name][q] = round(median_ms(step, reps), 2)
        print(f"  {name:12s} " + "  ".join(f"q={q}: {v:.1f} ms" for q, v in res[name].items()), flush=True)
        del target, model
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    reps = 5 if args.quick else 15
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, native bf16: {cpu_has_fast_bf16()}, "
          f"FBGEMM fp16: {fbgemm_fp16_available()}")
    print("matmuls (median ms):")
    mm = matmuls([1, 4, 17, 64] if args.quick else [1, 2, 4, 8, 17, 32, 64], reps * 2)
    print("SmolLM2-135M forward of q tokens over a 256-token cache (median ms):")
    fw = forwards([1, 2, 4, 8, 17] if args.quick else [1, 2, 4, 8, 12, 17, 32], reps)
    base = fw["bf16"]
    summary = {m: {q: round(v / base[q], 3) for q, v in rows.items()} for m, rows in fw.items()}
    print("forward cost relative to bf16 at the same q: " + json.dumps(summary))
    print(json.dumps({"native_bf16": cpu_has_fast_bf16(), "forward_ms": fw, "vs_bf16": summary,
                      "verify17_over_decode1": {m: round(r[17] / r[1], 2) for m, r in fw.items()}, "matmul_ms": mm}))


if __name__ == "__main__":
    main()
