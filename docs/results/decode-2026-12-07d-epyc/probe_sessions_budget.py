"""Sessions: the default engine with a 16-node budget (default) and a 32-node budget, beside HF prompt lookup
(10 tokens), interleaved request by request (engine arms' order alternating), own engines, cold prefills."""
import statistics, sys, time, torch
sys.path.insert(0, ".")
from trainer import data as D
from adaptive_eagle.engine import SpeculativeEngine
from adaptive_eagle.checkpoint import load_head
from adaptive_eagle.trace import SamplingParams
from adaptive_eagle.targets import load_target
from bench.decode import SHIPPED, engine_config, hf_generate, session_prompts

N = int(sys.argv[1]) if len(sys.argv) > 1 else 8
MAX_NEW = int(sys.argv[2]) if len(sys.argv) > 2 else 128
BUDGETS = [int(b) for b in (sys.argv[3] if len(sys.argv) > 3 else "16,32").split(",")]
torch.manual_seed(0)
target = load_target(prefill="auto")
loaded = load_head(SHIPPED, target, device=target.device)
encoder = SpeculativeEngine(target, None, engine_config(prompt_lookup=False, suffix_drafting=False, cost_aware=False,
                                                        calibration_dir=""))
arms = {f"budget {b}": (b, SpeculativeEngine(target, loaded, engine_config(depth=5, topk=4, num_draft_tokens=b, lookup_max_tokens=b,
                                                                            calibration_dir=""),
                                              head_version=loaded.meta.version)) for b in BUDGETS}
stats = {k: {"ttft": [], "tpot": [], "accept": [], "tree": [], "full": [], "same": 0} for k in [*arms, "hf-prompt-lookup"]}
first_arm = next(iter(arms))
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
        for name, (b, engine) in (list(arms.items()) if i % 2 == 0 else list(arms.items())[::-1]):
            engine.prefix_cache.clear()
            t0, first, res = time.perf_counter(), None, None
            for out, res in engine.stream(ids, SamplingParams(max_tokens=MAX_NEW)):
                if out and first is None:
                    first = time.perf_counter() - t0
            wall = time.perf_counter() - t0
            s = stats[name]
            s["ttft"].append(first); s["tpot"].append((wall - first) / (len(res.token_ids) - 1))
            s["accept"].append(res.accept_length_mean)
            steps = res.trace.steps
            s["tree"].append(statistics.mean(st.tree_size for st in steps) if steps else 0.0)
            s["full"].append(sum(st.tree_size >= b for st in steps) / max(1, len(steps)))
            outs[name] = res.token_ids
        for k in outs:
            stats[k]["same"] += outs[k] == outs[first_arm]
        print(f"request {i + 1}/{len(prompts)}: {len(ids)} prompt tokens; " + "; ".join(
            f"{k} TPOT {1e3 * s['tpot'][-1]:.1f} ms" + (f" accept {s['accept'][-1]:.2f} tree {s['tree'][-1]:.1f} "
                                                       f"full {s['full'][-1]:.2f}" if s['accept'] else "")
            for k, s in stats.items()), flush=True)
print(f"\n{len(prompts)} session requests, {MAX_NEW} new tokens; medians")
for k, s in stats.items():
    print(f"{k:18s} TTFT {statistics.median(s['ttft']):6.3f} s  TPOT {1e3 * statistics.median(s['tpot']):6.1f} ms"
          + (f"  accept {statistics.mean(s['accept']):.2f}  mean tree {statistics.mean(s['tree']):.1f}  "
             f"steps at the budget {statistics.mean(s['full']):.2f}" if s["accept"] else "")
          + f"  same tokens as {first_arm} {s['same']}/{len(prompts)}")
hf = statistics.median(stats["hf-prompt-lookup"]["tpot"])
for k in arms:
    print(f"{k}: TPOT {hf / statistics.median(stats[k]['tpot']):.3f}x HF prompt lookup")
