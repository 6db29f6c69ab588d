"""Where an English decoding step's time goes: the default engine (tree + lookup) with the shipped head."""
import sys, time, statistics, collections, torch
sys.path.insert(0, ".")
from bench.decode import SHIPPED, english_prompts, engine_config
from adaptive_eagle.checkpoint import load_head
from adaptive_eagle.engine import SpeculativeEngine
from adaptive_eagle.targets import load_target
from adaptive_eagle.trace import SamplingParams
from trainer import data as D
target = load_target(prefill="auto")
loaded = load_head(SHIPPED, target, device=target.device)
e = SpeculativeEngine(target, loaded, engine_config(depth=5, topk=4, num_draft_tokens=16, calibration_dir=sys.argv[1] if len(sys.argv) > 1 else None))
plain = SpeculativeEngine(target, None, engine_config(prompt_lookup=False, suffix_drafting=False, calibration_dir=""))
prompts = english_prompts(list(D.load_sharegpt()), 8)
t = collections.defaultdict(list); sizes = []
def wrap(name):
    f = getattr(e, name)
    def g(*a, **k):
        t0 = time.perf_counter(); r = f(*a, **k); t[name].append(time.perf_counter() - t0)
        if name == "_verify": sizes.append(a[1].size)
        return r
    setattr(e, name, g)
for n in ("_draft", "_verify", "_accept", "_capture"):
    wrap(n)
sp = SamplingParams(temperature=0, max_tokens=128)
with torch.inference_mode():
    tok = 0; wall = 0
    for p in prompts:
        t0 = time.perf_counter(); r = e.generate(p, sp); wall += time.perf_counter() - t0; tok += len(r.token_ids)
    pw = 0
    for p in prompts:
        t0 = time.perf_counter(); plain.generate(p, sp); pw += time.perf_counter() - t0
steps = len(t["_verify"])
print(f"tokens {tok}, steps {steps}, tokens/step {tok/steps:.2f}, spec wall {wall:.2f} s, plain wall {pw:.2f} s")
for k, v in t.items():
    print(f"{k:10s} total {sum(v):7.2f} s  per step {1000*sum(v)/steps:6.2f} ms  median {1000*statistics.median(v):6.2f} ms")
c = collections.Counter(sizes); print("tree sizes (verified drafts per step):", sorted(c.items()))
