"""The sessions workload's default engine with the threaded fp16 kernel (cpu_linear.THREADED_ROWS) and with every
linear on one thread, beside HF prompt lookup: interleaved request by request on bench/decode.py's session
requests (the engine arms' order alternating), each arm its own engine (own suffix index, no persisted calibration, verify costs timed at start with its own kernel), cold prefills. Per arm: median
time to first token and per output token, accept length, and the mean tree size the cost model chose. Run from
the repository root: .venv/bin/python <this file> [requests] [new tokens] (defaults 8 128)."""
import statistics, sys, time, torch
sys.path.insert(0, ".")
from adaptive_eagle import cpu_linear
from trainer import data as D
from adaptive_eagle.engine import SpeculativeEngine
from adaptive_eagle.checkpoint import load_head
from adaptive_eagle.trace import SamplingParams
from adaptive_eagle.targets import load_target
from bench.decode import SHIPPED, engine_config, hf_generate, session_prompts

N = int(sys.argv[1]) if len(sys.argv) > 1 else 8
MAX_NEW = int(sys.argv[2]) if len(sys.argv) > 2 else 128
torch.manual_seed(0)
target = load_target(prefill="auto")
print(target.compute, "threads", torch.get_num_threads(), "threaded kernel", cpu_linear.threaded_fp16_available(),
      flush=True)
loaded = load_head(SHIPPED, target, device=target.device)
tree = dict(depth=5, topk=4, num_draft_tokens=16)
encoder = SpeculativeEngine(target, None, engine_config(prompt_lookup=False, suffix_drafting=False, cost_aware=False,
                                                        calibration_dir=""))
THREADED = cpu_linear.THREADED_ROWS
arms = {}
for name, rows in (("threaded", THREADED), ("one thread", 10 ** 9)):
    cpu_linear.THREADED_ROWS = rows  # the engine times its verify costs at start with its own kernel
    arms[name] = rows, SpeculativeEngine(target, loaded, engine_config(**tree, calibration_dir=""),
                                         head_version=loaded.meta.version)
    print(name, "verify ms at 64 cached tokens:", {q: round(ms, 1) for q, ms in sorted(arms[name][1].verify_cost.points.items())}, flush=True)
cpu_linear.THREADED_ROWS = THREADED
stats = {k: {"ttft": [], "tpot": [], "accept": [], "tree": [], "same": 0} for k in [*arms, "hf-prompt-lookup"]}
with torch.inference_mode():
    prompts = session_prompts(list(D.load_sharegpt()), N, MAX_NEW, encoder)
    for i, prompt in enumerate(prompts):
        ids = encoder.encode(prompt)
        outs = {}
        t0 = time.perf_counter()
        toks, first = hf_generate(target, ids, MAX_NEW, 10)
        wall = time.perf_counter() - t0
        s = stats["hf-prompt-lookup"]
        s["ttft"].append(first); s["tpot"].append((wall - first) / (len(toks) - 1)); outs["hf-prompt-lookup"] = toks
        for name, (rows, engine) in (list(arms.items()) if i % 2 == 0 else list(arms.items())[::-1]):
            cpu_linear.THREADED_ROWS = rows
            engine.prefix_cache.clear()
            t0, first, res = time.perf_counter(), None, None
            for out, res in engine.stream(ids, SamplingParams(max_tokens=MAX_NEW)):
                if out and first is None:
                    first = time.perf_counter() - t0
            wall = time.perf_counter() - t0
            s = stats[name]
            s["ttft"].append(first); s["tpot"].append((wall - first) / (len(res.token_ids) - 1))
            s["accept"].append(res.accept_length_mean)
            s["tree"].append(statistics.mean(st.tree_size for st in res.trace.steps) if res.trace.steps else 0.0)
            outs[name] = res.token_ids
        cpu_linear.THREADED_ROWS = THREADED
        for k in outs:
            stats[k]["same"] += outs[k] == outs["threaded"]
        print(f"request {i + 1}/{len(prompts)}: {len(ids)} prompt tokens; " + "; ".join(
            f"{k} TPOT {1e3 * s['tpot'][-1]:.1f} ms" + (f" accept {s['accept'][-1]:.2f} tree {s['tree'][-1]:.1f}"
                                                       if s['accept'] else "") for k, s in stats.items()), flush=True)
print(f"\n{len(prompts)} session requests, {MAX_NEW} new tokens; medians")
for k, s in stats.items():
    print(f"{k:18s} TTFT {statistics.median(s['ttft']):6.3f} s  TPOT {1e3 * statistics.median(s['tpot']):6.1f} ms"
          + (f"  accept {statistics.mean(s['accept']):.2f}  mean tree {statistics.mean(s['tree']):.1f}"
             if s["accept"] else "") + f"  same tokens as threaded {s['same']}/{len(prompts)}")
hf = statistics.median(stats["hf-prompt-lookup"]["tpot"])
for k in arms:
    print(f"{k}: TPOT {hf / statistics.median(stats[k]['tpot']):.3f}x HF prompt lookup")
