"""Sessions requests (bench/decode.py's): the default engine vs config variants vs HF prompt lookup, interleaved (arm order
rotating). Run from the repository root: python <this file> <requests> <new tokens> '{"name": {EngineConfig overrides}}'."""
import statistics, sys, time, json, torch
sys.path.insert(0, ".")
from trainer import data as D
from adaptive_eagle.engine import SpeculativeEngine
from adaptive_eagle.checkpoint import load_head
from adaptive_eagle.trace import SamplingParams
from adaptive_eagle.targets import load_target
from bench.decode import SHIPPED, engine_config, hf_generate, session_prompts
N, MAX_NEW = int(sys.argv[1]), int(sys.argv[2])
VARIANTS = json.loads(sys.argv[3])  # {"name": {config overrides}}
torch.manual_seed(0)
target = load_target(prefill="auto")
loaded = load_head(SHIPPED, target, device=target.device)
tree = dict(depth=5, topk=4, num_draft_tokens=16)
encoder = SpeculativeEngine(target, None, engine_config(prompt_lookup=False, suffix_drafting=False, cost_aware=False, calibration_dir=""))
arms = {k: SpeculativeEngine(target, loaded, engine_config(**{**tree, "calibration_dir": "", **kw}), head_version=loaded.meta.version) for k, kw in VARIANTS.items()}
stats = {k: {"tpot": [], "accept": [], "tree": [], "same": 0} for k in [*arms, "hf-pl"]}
with torch.inference_mode():
    prompts = session_prompts(list(D.load_sharegpt()), N, MAX_NEW, encoder)
    for i, prompt in enumerate(prompts):
        ids = encoder.encode(prompt)
        outs = {}
        names = [*arms, "hf-pl"]
        names = names[i % len(names):] + names[:i % len(names)]
        for name in names:
            if name == "hf-pl":
                t0 = time.perf_counter(); toks, first = hf_generate(target, ids, MAX_NEW, 10); wall = time.perf_counter() - t0
                stats[name]["tpot"].append((wall - first) / (len(toks) - 1)); outs[name] = toks; continue
            engine = arms[name]; engine.prefix_cache.clear()
            t0, first, res = time.perf_counter(), None, None
            for out, res in engine.stream(ids, SamplingParams(max_tokens=MAX_NEW)):
                if out and first is None: first = time.perf_counter() - t0
            wall = time.perf_counter() - t0
            s = stats[name]; s["tpot"].append((wall - first) / (len(res.token_ids) - 1)); s["accept"].append(res.accept_length_mean)
            s["tree"].append(statistics.mean(st.tree_size for st in res.trace.steps) if res.trace.steps else 0.0)
            outs[name] = res.token_ids
        ref = outs[next(iter(arms))]
        for k in outs: stats[k]["same"] += outs[k] == ref
        print(f"req {i+1}: {len(ids)} tok; " + "; ".join(f"{k} {1e3*s['tpot'][-1]:.1f}ms" + (f" a{s['accept'][-1]:.2f} t{s['tree'][-1]:.1f}" if s["accept"] else "") for k, s in stats.items()), flush=True)
hf = statistics.median(stats["hf-pl"]["tpot"])
for k, s in stats.items():
    print(f"{k:12s} TPOT p50 {1e3*statistics.median(s['tpot']):.1f} ms  vs HF PL {hf/statistics.median(s['tpot']):.3f}x  geomean ratio {statistics.geometric_mean([h/x for h, x in zip(stats['hf-pl']['tpot'], s['tpot'])]):.3f}  same {s['same']}/{len(prompts)}")
