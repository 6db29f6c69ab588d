"""Probe: where a cold prefill's time goes, engine vs HF's one bf16 forward."""
import statistics, sys, time
import torch
sys.path.insert(0, ".")
from transformers import DynamicCache
from bench.decode import load_prompts, engine_config
from adaptive_eagle.engine import SpeculativeEngine
from adaptive_eagle.kv_cache import GrowingCache
from adaptive_eagle.targets import load_target
from trainer import data as D

torch.manual_seed(0)
target = load_target(prefill="auto")
fast = target.prefill_model
q = dict(calibration_dir="", prefix_cache_mb=0, prompt_lookup=False, suffix_drafting=False)
engines = {b: SpeculativeEngine(target, None, engine_config(prefill_block=b, **q)) for b in (256, 512, 4096)}
convs = list(D.load_sharegpt())
prompts = load_prompts("sessions", convs, 8, 128, engines[256], [])
ids_all = sorted((engines[256].encode(p) for p in prompts), key=len)
ids_all = [i for i in ids_all if 1500 <= len(i) <= 2600][:3] or ids_all[3:6]
print("prompt lengths", [len(i) for i in ids_all])
t = {}
def timed(k, fn):
    t0 = time.perf_counter(); fn(); t.setdefault(k, []).append(time.perf_counter() - t0)
with torch.inference_mode():
    for r in range(3):
        for ids in ids_all:
            x = torch.tensor([ids])
            timed("hf_bf16_one_forward", lambda: fast(input_ids=x, use_cache=True, logits_to_keep=1))
            timed("hf_bf16_one_forward_hidden", lambda: fast(input_ids=x, use_cache=True, logits_to_keep=1, output_hidden_states=True))
            for b, e in engines.items():
                timed(f"engine_block{b}_aux", lambda: e._prefill_blocks(ids, GrowingCache(), True, False))
            e = engines[256]
            timed("engine_block256_noaux", lambda: e._prefill_blocks(ids, GrowingCache(), False, False))
            timed("engine_block256_bf16_only", lambda: e._prefill_into(ids, GrowingCache(), False, False, fast))
            timed("engine_block256_bf16_only_dynamic", lambda: e._prefill_into(ids, DynamicCache(), False, False, fast))
for k, v in t.items():
    print(f"{k:40s} {statistics.median(v):.3f} s")
