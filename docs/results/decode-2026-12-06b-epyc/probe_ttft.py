"""Probe: time to first token on the sessions prompts, cold prefix (prefix cache off), plain[bf16] vs
plain[fp32+fp16-weights] vs the default speculative engine, interleaved, R repeats (argv[1]). Run from the repository root."""
import statistics, sys, time
import torch
sys.path.insert(0, ".")
from bench.decode import load_prompts, engine_config, SHIPPED
from adaptive_eagle.checkpoint import load_head
from adaptive_eagle.engine import SpeculativeEngine
from adaptive_eagle.targets import load_target
from adaptive_eagle.trace import SamplingParams
from trainer import data as D

R = int(sys.argv[1]) if len(sys.argv) > 1 else 2
torch.manual_seed(0)
target = load_target(prefill="auto")
bf16 = load_target(compute="bf16")
loaded = load_head(SHIPPED, target, device=target.device)
q = dict(calibration_dir="", prefix_cache_mb=0)
plain = SpeculativeEngine(target, None, engine_config(prompt_lookup=False, suffix_drafting=False, **q))
plainb = SpeculativeEngine(bf16, None, engine_config(prompt_lookup=False, suffix_drafting=False, **q))
spec = SpeculativeEngine(target, loaded, engine_config(depth=5, topk=4, num_draft_tokens=16, **q))
convs = list(D.load_sharegpt())
prompts = load_prompts("sessions", convs, 8, 128, plain, [])
times = {"plain[bf16]": [], "plain[fp16w]": [], "spec": [], "spec_gap2": []}
def first(engine, ids, key):
    t0 = time.perf_counter(); it = engine.stream(ids, SamplingParams(max_tokens=3))
    next(it); t1 = time.perf_counter(); times[key].append(t1 - t0)
    next(it)
    if key == "spec": times["spec_gap2"].append(time.perf_counter() - t1)
    for _ in it: pass
with torch.inference_mode():
    for r in range(R):
        for p in prompts:
            ids = plain.encode(p)
            for e, k in ((plainb, "plain[bf16]"), (plain, "plain[fp16w]"), (spec, "spec")):
                first(e, ids, k)
med = {k: statistics.median(v) for k, v in times.items()}
print({k: round(v, 3) for k, v in med.items()}, "n =", len(times["spec"]))
print("spec / plain[fp16w]", round(med["spec"] / med["plain[fp16w]"], 3), "spec / plain[bf16]", round(med["spec"] / med["plain[bf16]"], 3))
ratios = [s / p for s, p in zip(times["spec"], times["plain[fp16w]"])]
print("paired spec/plain[fp16w] median", round(statistics.median(ratios), 3))
ratios = [s / p for s, p in zip(times["spec"], times["plain[bf16]"])]
print("paired spec/plain[bf16] median", round(statistics.median(ratios), 3))
