"""Table and plot of the run and its control: by-position.json + control.json -> table.txt, accept_length.png.

Run from the repository root: .venv/bin/python docs/results/longctx-2026-12-01/plot.py
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from trainer.train_head import position_table  # noqa: E402

HERE = Path(__file__).resolve().parent
runs = {"in the session (eval-head --by-position)": json.loads((HERE / "by-position.json").read_text())["english"],
        "own conversation only (control.py)": json.loads((HERE / "control.json").read_text())["english"]}
(HERE / "table.txt").write_text("\n".join(f"{name}\n{position_table('english', r)}\n" for name, r in runs.items()))

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
for (name, r), style in zip(runs.items(), ("o-", "s--")):
    buckets = r["by_position"]
    labels = [b["bucket"] for b in buckets]
    ax1.plot(labels, [b["accept_length"] for b in buckets], style, label=name)
    ax2.plot(labels, [b["alpha"][0] for b in buckets], style, label=name)
for x, b in enumerate(runs["in the session (eval-head --by-position)"]["by_position"]):
    ax1.annotate(f"{b['positions']:,}", (x, b["accept_length"]), textcoords="offset points", xytext=(0, -14),
                 ha="center", fontsize=7)
ax1.set(title="accept length (7-token chain, bonus included)", xlabel="context position of the draft",
        ylabel="tokens per step")
ax2.set(title="0-α (first draft token accepted)", xlabel="context position of the draft", ylabel="0-α")
for ax in (ax1, ax2):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
fig.suptitle("shipped head smollm2-135m-english-v2, 10 held-out English sessions of 8,192 tokens "
             "(numbers: positions per bucket)", fontsize=10)
fig.tight_layout()
fig.savefig(HERE / "accept_length.png", dpi=110)
