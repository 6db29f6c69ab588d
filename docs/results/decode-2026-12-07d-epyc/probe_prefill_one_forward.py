"""Are a prompt's keys and values from one bf16 forward bit-equal to those from the engine's 256-token blocks
(and from 512-token blocks)? 1,024 tokens of held-out ShareGPT text. Run from the repository root."""
import sys, torch
sys.path.insert(0, ".")
from adaptive_eagle.targets import load_target
from adaptive_eagle.engine import SpeculativeEngine, EngineConfig
from adaptive_eagle.kv_cache import GrowingCache
from trainer import data as D
t = load_target("smollm2-135m", prefill="auto")
print(t.compute, t.prefill_choice)
eng = SpeculativeEngine(t, None, EngineConfig(prompt_lookup=False, suffix_drafting=False, prefix_cache_mb=0))
text = " ".join(D.first_user_messages(D.load_sharegpt(), 40, domains=["english"], split="heldout"))
ids = t.tokenizer.encode(text)[:1024]
print(len(ids))
a = GrowingCache()
with torch.inference_mode():
    la, _, _ = eng._prefill_into(ids, a, False, False, t.prefill_model)
    b = GrowingCache()
    lb, _, _ = eng._target_forward(ids, b, torch.arange(len(ids)), None, False, False, logits="last", model=t.prefill_model)
    for size in (512,):
        c = GrowingCache()
        for s in range(0, len(ids), size):
            lc, _, _ = eng._target_forward(ids[s:s+size], c, torch.arange(s, min(s+size, len(ids))), None, False, False, logits="last" if s+size>=len(ids) else "none", model=t.prefill_model)
diff = [float((x.keys - y.keys).abs().max()) for x, y in zip(a.layers, b.layers)]
print("blocks256 vs one forward: max |dK| per layer", diff[:4], "...", max(diff), "logits equal", torch.equal(la[-1:], lb[-1:]))
diff = [float((x.keys - y.keys).abs().max()) for x, y in zip(a.layers, c.layers)]
print("blocks256 vs blocks512:", max(diff))
d1 = [float((x.keys - y.keys).abs().max()) for x, y in zip(a.layers, b.layers)]
print("first differing layer (K):", next((i for i, v in enumerate(d1) if v), None))
dv = [float((x.values - y.values).abs().max()) for x, y in zip(a.layers, b.layers)]
print("first differing layer (V):", next((i for i, v in enumerate(dv) if v), None))
# which rows differ at that layer
i = next((i for i, v in enumerate(d1) if v), None)
if i is not None:
    rows = ((a.layers[i].keys - b.layers[i].keys).abs().amax(dim=(0, 1, 3)) > 0).nonzero().flatten()
    print("rows differing at layer", i, rows[:10].tolist(), "count", rows.numel())
