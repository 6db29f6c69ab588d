"""Control for the by-position run: the same scored tokens with only their own conversation as context.

Builds the same long held-out sessions as `eval-head --by-position --domains english --sessions 10
--max-len 8192`, renders each chained conversation on its own (the template's system prompt, then its
turns: the same tokens as in the session), scores it with the TTT evaluation, and counts every chain row
in the bucket of the position it had in the session. Rows, tokens and masks are identical to the session
run, so bucket by bucket the difference is the long history alone. Writes control.json.

Run from the repository root: nice -n 5 .venv/bin/python docs/results/longctx-2026-12-01/control.py
"""

import json
import time
from pathlib import Path

import torch

from adaptive_eagle import checkpoint as C
from adaptive_eagle.cli import SHIPPED_HEAD
from adaptive_eagle.targets import load_target
from trainer.data import load_sharegpt, render
from trainer.offline import make_ttt_batch, rounded
from trainer.positions import DEFAULT_EDGES, PositionTally
from trainer.sessions import long_sessions
from trainer.ttt import acceptance_summary, ttt_loss

SESSIONS, LENGTH, STEPS = 10, 8192, 7
t0 = time.time()
target = load_target("smollm2-135m", purpose="train")
head = C.load_head(SHIPPED_HEAD, target).head.float().eval()
bf16 = target.dtype == torch.bfloat16
im_start = target.tokenizer.convert_tokens_to_ids("<|im_start|>")
sessions = long_sessions(list(load_sharegpt()), target.tokenizer, min_tokens=LENGTH, max_tokens=LENGTH,
                         n=SESSIONS, split="heldout", domains=["english"])
tally = PositionTally(DEFAULT_EDGES, STEPS)
tot = {k: [0] * STEPS for k in ("correct", "count", "accept", "eligible")}
for s in sessions:
    ids = s.example.input_ids
    for part, start in zip(s.parts, s.starts):
        alone = render(part, target.tokenizer)
        own = 0 if start == 0 else alone.input_ids.index(im_start, 1)  # the system prompt's length
        keep = own + min(len(alone.input_ids) - own, len(ids) - start)  # cut where the session was cut
        assert alone.input_ids[own:keep] == ids[start : start + keep - own], (s.example.id, part.id)
        assert alone.loss_mask[own:keep] == s.example.loss_mask[start : start + keep - own], (s.example.id, part.id)
        if not any(alone.loss_mask[2:keep]):  # no chain row (a part cut before its answer): nothing to score
            continue
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            batch = make_ttt_batch(target, head, [alone], keep, exact=True)
            out = ttt_loss(head, batch, steps=STEPS)
        tally.add(out.row_position + (start - own), out.row_eligible, out.row_accepted)
        for k, v in (("correct", out.step_correct), ("count", out.step_count), ("accept", out.step_accept),
                     ("eligible", out.step_eligible)):
            tot[k] = [a + b for a, b in zip(tot[k], v)]
    print(f"{s.example.id}: {len(s.parts)} conversations, {time.time() - t0:.0f} s", flush=True)
summary = acceptance_summary(tot["correct"], tot["count"], tot["accept"], tot["eligible"])
summary["by_position"] = tally.summary(limit=LENGTH)
result = {"english": {**rounded(summary), "sessions": len(sessions), "session_tokens": LENGTH,
                      "conversations": sum(len(s.parts) for s in sessions), "seconds": round(time.time() - t0)}}
(Path(__file__).resolve().parent / "control.json").write_text(json.dumps(result, indent=1) + "\n")
print(json.dumps(result))
