"""Held-out chain acceptance of two heads on the target's own answers (the regen-data file's held-out split),
next to ShareGPT's held-out English. Usage: probe_heldout_target_text.py REGEN_JSONL HEAD [HEAD ...]"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from adaptive_eagle.targets import load_target  # noqa: E402
from trainer import data as D  # noqa: E402
from trainer.train_head import domain_result, head_from  # noqa: E402

jsonl, heads = sys.argv[1], sys.argv[2:]
target = load_target("smollm2-135m", purpose="train")
sets = {
    "target's answers (held-out prompts)": D.tokenize_all(D.select(D.load_jsonl(jsonl), split="heldout"),
                                                           target.tokenizer, max_len=512),
    "ShareGPT English (held-out)": D.tokenize_all(list(D.select(D.load_sharegpt(), domains=["english"],
                                                                split="heldout"))[:24], target.tokenizer, max_len=512),
}
for h in heads:
    head = head_from(Path(h), target).head.eval()
    for name, exs in sets.items():
        r = domain_result(head, target, exs, max_len=512, bf16=False)
        print(f"{Path(h).name:26s} {name:38s} conv {r['conversations']:3d} positions {r['positions']:5d} "
              f"0-a {r['alpha'][0]:.3f} 1-a {r['alpha'][1]:.3f} accept length {r['accept_length']:.3f}")
