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
    c = GrowingCache()  # 512-token blocks
    for s in range(0, len(ids), 512):
        stop = min(s + 512, len(ids))
        eng._target_forward(ids[s:stop], c, torch.arange(s, stop), None, False, False,
                            logits="last" if stop == len(ids) else "none", model=t.prefill_model)
dk = [float((x.keys - y.keys).abs().max()) for x, y in zip(a.layers, b.layers)]
dv = [float((x.values - y.values).abs().max()) for x, y in zip(a.layers, b.layers)]
print("blocks256 vs one forward: max |dK| per layer", dk[:4], "...", max(dk), "logits equal", torch.equal(la[-1:], lb[-1:]))
print("blocks256 vs blocks512:", max(float((x.keys - y.keys).abs().max()) for x, y in zip(a.layers, c.layers)))
first_k = next((i for i, v in enumerate(dk) if v), None)
print("first differing layer (K):", first_k)
print("first differing layer (V):", next((i for i, v in enumerate(dv) if v), None))
if first_k is not None:  # which rows differ at that layer
    rows = ((a.layers[first_k].keys - b.layers[first_k].keys).abs().amax(dim=(0, 1, 3)) > 0).nonzero().flatten()
    print("rows differing at layer", first_k, rows[:10].tolist(), "count", rows.numel())
