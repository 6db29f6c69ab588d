"""Probe: a cold prefill of the 2,252-token sessions prompt: HF one bf16 forward, the engine with the LM head on
the last row as a matrix (split) and through logits_to_keep=1 at every block (nosplit), and HF's decoder alone in
256-token blocks."""
import statistics, sys, time, torch
sys.path.insert(0, ".")  # run from the repository root
from bench.decode import load_prompts, engine_config
from adaptive_eagle.engine import SpeculativeEngine
from adaptive_eagle.kv_cache import GrowingCache
from adaptive_eagle.targets import load_target
from trainer import data as D
torch.manual_seed(0)
target = load_target(prefill="auto"); fast = target.prefill_model
q = dict(calibration_dir="", prefix_cache_mb=0, prompt_lookup=False, suffix_drafting=False)
e = SpeculativeEngine(target, None, engine_config(prefill_block=256, **q))
print("split", e._split_head)
prompts = load_prompts("sessions", list(D.load_sharegpt()), 8, 128, e, [])
ids = [i for i in sorted((e.encode(p) for p in prompts), key=len) if 1500 <= len(i) <= 2600][-1]
t = {}
def timed(k, fn):
    t0 = time.perf_counter(); fn(); t.setdefault(k, []).append(time.perf_counter() - t0)
x = torch.tensor([ids])
with torch.inference_mode():
    for r in range(4):
        timed("hf", lambda: fast(input_ids=x, use_cache=True, logits_to_keep=1))
        e._split_head = True
        timed("split", lambda: e._prefill_blocks(ids, GrowingCache(), True, False))
        e._split_head = False
        timed("nosplit", lambda: e._prefill_blocks(ids, GrowingCache(), True, False))
        c = GrowingCache()
        def fw():
            for s in range(0, len(ids), 256):
                fast.model(input_ids=x[:, s:s+256], past_key_values=c, use_cache=True, position_ids=torch.arange(s, min(s+256, len(ids)))[None])
        timed("bare_blocks_decoder", fw)
for k, v in t.items():
    print(f"{k:12s} {statistics.median(v):.3f} s {[round(a,2) for a in v]}")
