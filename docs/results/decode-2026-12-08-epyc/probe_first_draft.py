"""A fresh engine's first request: how long its drafting calls take (bench/decode.py's session request 1 by default,
argument: request numbers, comma-separated). Prints the head's feed calls (pending tokens, ms), the slowest draft
steps, and any draft_tree call over 20 ms. Run from the repository root in a fresh process: the row-stability
probes of cpu_linear are cached per process."""
import sys, time, torch
sys.path.insert(0, ".")
import adaptive_eagle.engine as EM
from bench.decode import SHIPPED, engine_config, session_prompts
from adaptive_eagle.checkpoint import load_head
from adaptive_eagle.engine import SpeculativeEngine
from adaptive_eagle.targets import load_target
from adaptive_eagle.trace import SamplingParams
from adaptive_eagle import drafting
from trainer import data as D
target = load_target(prefill="auto")
loaded = load_head(SHIPPED, target, device=target.device)
e = SpeculativeEngine(target, loaded, engine_config(depth=5, topk=4, num_draft_tokens=16, calibration_dir=""))
enc = SpeculativeEngine(target, None, engine_config(prompt_lookup=False, suffix_drafting=False, cost_aware=False,
                                                    calibration_dir=""))
prompts = session_prompts(list(D.load_sharegpt()), 8, 128, enc)
feeds, drafts = [], []
orig_root, orig_tree, orig_draft = drafting.HeadFeed.root, EM.draft_tree, e._draft


def root(self, *a, **k):
    n, t0 = len(self.tokens), time.perf_counter()
    r = orig_root(self, *a, **k)
    feeds.append((n, round((time.perf_counter() - t0) * 1e3, 1)))
    return r


def tree(*a, **k):
    t0 = time.perf_counter()
    r = orig_tree(*a, **k)
    if (ms := (time.perf_counter() - t0) * 1e3) > 20:
        print(f"   draft_tree took {ms:.1f} ms", flush=True)
    return r


def draft(*a, **k):
    t0 = time.perf_counter()
    r = orig_draft(*a, **k)
    drafts.append((time.perf_counter() - t0) * 1e3)
    return r


drafting.HeadFeed.root, EM.draft_tree, e._draft = root, tree, draft
with torch.inference_mode():
    for i in [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "1").split(",")]:
        ids = enc.encode(prompts[i - 1])
        feeds.clear(), drafts.clear(), e.prefix_cache.clear()
        e.generate(ids, SamplingParams(max_tokens=128))
        print(f"request {i} ({len(ids)} prompt tokens): head feeds (pending tokens, ms), slowest first: "
              f"{sorted(feeds, key=lambda f: -f[1])[:3]}; draft steps {len(drafts)}, {sum(drafts):.0f} ms in all, "
              f"slowest {[round(x, 1) for x in sorted(drafts)[-3:]]}", flush=True)
