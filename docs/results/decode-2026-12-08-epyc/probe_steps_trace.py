"""Step by step, one of bench/decode.py's session requests (argument: its number, 1-8) in the default engine with the
shipped head: per verify step, whether it speculated, the prompt-lookup chain offered and kept, the tree size, the
head's part, the lookup calibration's estimates at depths 1, 2, 4, 8, the verify ms and the drafts accepted."""
import sys, time, torch
sys.path.insert(0, ".")
from bench.decode import SHIPPED, engine_config, session_prompts
from adaptive_eagle.checkpoint import load_head
from adaptive_eagle.engine import SpeculativeEngine
from adaptive_eagle.targets import load_target
from adaptive_eagle.trace import SamplingParams
from trainer import data as D
target = load_target(prefill="auto")
loaded = load_head(SHIPPED, target, device=target.device)
e = SpeculativeEngine(target, loaded, engine_config(depth=5, topk=4, num_draft_tokens=16, calibration_dir=""))
enc = SpeculativeEngine(target, None, engine_config(prompt_lookup=False, suffix_drafting=False, cost_aware=False, calibration_dir=""))
prompts = session_prompts(list(D.load_sharegpt()), 8, 128, enc)
log = []
od, osp, ov = e._draft, e._speculates, e._verify
cur = {}
def spec(state):
    r = osp(state); cur["spec"] = r; return r
def draft(state, head_ok=True):
    cont, suf = e._model_free(state.context, state.request.tenant)
    p = od(state, head_ok); cur.update(cont=len(cont), size=p.tree.size, lookup=len(p.lookup), head=p.head_drafted, head_ok=head_ok,
        est=[round(e.binding.calibration.lookup(d), 2) for d in (1, 2, 4, 8)] if cont else None); return p
def verify(state, tree, bits=None):
    t0 = time.perf_counter(); v = ov(state, tree, bits); cur["ms"] = (time.perf_counter() - t0) * 1e3; cur["acc"] = v.result.accepted_drafts
    log.append(dict(cur)); cur.clear(); return v
e._draft, e._speculates, e._verify = draft, spec, verify
i = int(sys.argv[1])
ids = enc.encode(prompts[i - 1])
with torch.inference_mode():
    r = e.generate(ids, SamplingParams(max_tokens=128))
for k, s in enumerate(log):
    print(k, s)
print("overhead", e.overhead_ms, "rate", e.rate, {q: round(e.verify_cost.at(len(ids))(q), 1) for q in (1, 2, 4, 8, 16, 17)})
