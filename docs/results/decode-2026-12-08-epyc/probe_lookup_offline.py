"""What prompt lookup could accept on bench/decode.py's 8 session requests, offline (no timing): the requests' plain greedy
outputs, and at every output position the continuation each lookup rule proposes, scored by how many of its tokens
the output then has. Rules: the engine's (longest recurring suffix of 6 down to 2 tokens, most recent occurrence, up
to 16 tokens), its unigram fallback where no bigram recurs, and HF's prompt lookup (bigram then unigram, earliest
occurrence, 10 tokens). Run from the repository root."""
import sys, torch, statistics
sys.path.insert(0, ".")
from bench.decode import SHIPPED, engine_config, session_prompts
from adaptive_eagle.engine import SpeculativeEngine
from adaptive_eagle.targets import load_target
from adaptive_eagle.trace import SamplingParams
from adaptive_eagle.lookup import suffix_match_continuation
from trainer import data as D
target = load_target(prefill="auto")
enc = SpeculativeEngine(target, None, engine_config(calibration_dir=""))  # lookup on, no head: fast exact greedy
prompts = session_prompts(list(D.load_sharegpt()), 8, 128, SpeculativeEngine(target, None, engine_config(prompt_lookup=False, suffix_drafting=False, cost_aware=False, calibration_dir="")))
def hf_match(ctx, k=10):
    n = len(ctx)
    for size in (2, 1):
        if n <= size: continue
        pat = ctx[n-size:]
        for s in range(0, n - size):
            if ctx[s:s+size] == pat:
                f = ctx[s+size:s+size+k]
                if f: return f
    return []
with torch.inference_mode():
    for i, p in enumerate(prompts):
        ids = enc.encode(p); enc.prefix_cache.clear()
        out = enc.generate(ids, SamplingParams(max_tokens=128)).token_ids
        full = ids + out
        stats = {"bi": [0, 0], "uni": [0, 0], "none": 0, "hf": [0, 0]}
        pos = len(ids)
        # simulate chains: at each position, what would each proposer accept (greedy chain acceptance)
        for t in range(len(ids), len(full)):
            ctx, fut = full[:t], full[t:]
            def acc(c): 
                k = 0
                while k < len(c) and k < len(fut) and c[k] == fut[k]: k += 1
                return k
            bi = suffix_match_continuation(ctx, 16, 2)
            if bi:
                stats["bi"][0] += 1; stats["bi"][1] += acc(bi)
            else:
                uni = suffix_match_continuation(ctx, 16, 1)
                if uni: stats["uni"][0] += 1; stats["uni"][1] += acc(uni)
                else: stats["none"] += 1
            h = hf_match(ctx); stats["hf"][0] += bool(h); stats["hf"][1] += acc(h)
        print(f"req {i+1} ctx {len(ids)} out {len(out)}: positions with bigram+ lookup {stats['bi'][0]} (mean accepted {stats['bi'][1]/max(1,stats['bi'][0]):.2f}); unigram-only {stats['uni'][0]} (mean accepted {stats['uni'][1]/max(1,stats['uni'][0]):.2f}); none {stats['none']}; HF-style {stats['hf'][0]} (mean {stats['hf'][1]/max(1,stats['hf'][0]):.2f})", flush=True)
