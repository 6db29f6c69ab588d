"""A target forward's cost at 1-17 rows over a 120-token cache, fp16-weight linears on one thread vs the threaded
kernel from cpu_linear.THREADED_ROWS rows on: interleaved in one process (medians of 12 pairs), with the logits of
both compared bit for bit. Run from the repository root: .venv/bin/python <this file> [cache tokens] [pairs] [rows,...]
(defaults 120 12 1,2,4,8,12,17; the long-context run: 2000 6 1,8,17)."""
import sys, time, torch
sys.path.insert(0, ".")
from transformers import DynamicCache
from adaptive_eagle import cpu_linear
from adaptive_eagle.engine import SpeculativeEngine
from adaptive_eagle.kv_cache import keep_rows
from adaptive_eagle.targets import load_target
from bench.decode import engine_config

target = load_target(prefill="auto")
print(target.compute, "threads", torch.get_num_threads(), "threaded kernel", cpu_linear.threaded_fp16_available())
e = SpeculativeEngine(target, None, engine_config(prompt_lookup=False, suffix_drafting=False, calibration_dir=""))
P = int(sys.argv[1]) if len(sys.argv) > 1 else 120
PAIRS = int(sys.argv[2]) if len(sys.argv) > 2 else 12
SIZES = [int(q) for q in sys.argv[3].split(",")] if len(sys.argv) > 3 else [1, 2, 4, 8, 12, 17]
ARMS = {"one thread": 10 ** 9, "threaded": cpu_linear.THREADED_ROWS}
cache = DynamicCache()
with torch.inference_mode():
    e._target_forward(list(range(1000, 1000 + P)), cache, torch.arange(P), None, aux=False, logits="last")
    for q in SIZES:
        mask = torch.zeros(1, 1, q, P + q)
        mask[0, 0, :, P:] = torch.triu(torch.full((q, q), torch.finfo(torch.float32).min), 1)
        def fwd():
            r = e._target_forward(list(range(2000, 2000 + q)), cache, torch.arange(P, P + q), mask, aux=True)
            keep_rows(cache, torch.arange(P))
            return r[0]
        ts, logits = {k: [] for k in ARMS}, {}
        for rep in range(PAIRS):
            for name, rows in ARMS.items():
                cpu_linear.THREADED_ROWS = rows
                logits[name] = fwd()
                t0 = time.perf_counter(); fwd(); fwd(); ts[name].append((time.perf_counter() - t0) / 2)
        a, b = (1000 * sorted(ts[k])[PAIRS // 2] for k in ARMS)
        print(f"{q:2d} rows: one thread {a:5.1f} ms  threaded {b:5.1f} ms  ratio {b / a:.2f}  "
              f"same logits: {torch.equal(*logits.values())}", flush=True)
