"""Install a head trained in the GPU window (CPU side, after the device calls).

Owns: joining the head the device returned under $OUT (export.json: pieces and sha256), scoring it
and the shipped head on this machine with the project's held-out evaluation (what
`adaptive-eagle eval-head` prints), the decision (``decide``, a pure function), and, when the new
head wins, writing it under heads/<version>/ with the comparison recorded in its head.json. Must not
touch: the shipped head's files, the registry's champion, code that names the shipped head (it prints
those places instead).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from ops.gpu_train.parts import PartError
from ops.gpu_train.train_gpu import import_head
from trainer.train_head import EVAL_DOMAINS

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "heads" / "smollm2-135m-english-v2"


def find_export(files_at: Path) -> Path:
    """The returned head: $OUT/head, or a half-swapped head.new / head.old when a timeout hit the export."""
    tried = []
    for name in ("head", "head.new", "head.old"):
        d = Path(files_at) / name
        if (d / "export.json").is_file():
            return d
        tried.append(str(d))
    raise PartError(f"no exported head (export.json) under {tried}")


def decide(new: dict, old: dict, domains: Sequence[str] = EVAL_DOMAINS, max_drop: float = 0.01) -> tuple[bool, str]:
    """Replace the shipped head when the new one's mean held-out accept length over `domains` is higher
    and no domain drops by more than `max_drop` (relative)."""
    missing = [d for d in domains if d not in new or d not in old]
    if missing:
        return False, f"no held-out result for {missing}"
    a_new = {d: new[d]["accept_length"] for d in domains}
    a_old = {d: old[d]["accept_length"] for d in domains}
    mean_new, mean_old = sum(a_new.values()) / len(domains), sum(a_old.values()) / len(domains)
    drops = {d: a_new[d] / a_old[d] - 1 for d in domains if a_new[d] < a_old[d] * (1 - max_drop)}
    table = ", ".join(f"{d} {a_old[d]:.3f}->{a_new[d]:.3f}" for d in domains)
    if drops:
        return False, f"{table}: drops beyond {max_drop:.0%} on {sorted(drops)}"
    if mean_new <= mean_old:
        return False, f"{table}: mean {mean_old:.3f}->{mean_new:.3f}, not higher"
    return True, f"{table}: mean {mean_old:.3f}->{mean_new:.3f}"


def evaluate_heads(heads: Sequence[Path], n_convs: int, max_len: int) -> list[dict]:
    """run_eval_head for each head on one loaded target (the head's own target_name)."""
    from adaptive_eagle.targets import load_target
    from trainer.train_head import run_eval_head

    name = json.loads((Path(heads[0]) / "head.json").read_text())["target_name"]
    target = load_target(name, purpose="train")
    return [run_eval_head(Path(h), target, EVAL_DOMAINS, n_convs, max_len) for h in heads]


def references(version: str) -> list[str]:
    """Files that name the shipped head (to repoint by hand when a new head replaces it)."""
    out = subprocess.run(["git", "grep", "-l", version, "--", ":!heads"], cwd=REPO, capture_output=True, text=True, check=False)
    return out.stdout.split()


def main(argv: Sequence[str] | None = None) -> int:
    from adaptive_eagle.checkpoint import update_metrics

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files_at", type=Path, help="where the device's $OUT files landed (run's files_at)")
    ap.add_argument("--shipped", type=Path, default=SHIPPED)
    ap.add_argument("--staging", type=Path, default=REPO / "runs" / "gpu", help="joined heads land here first")
    ap.add_argument("--heads", type=Path, default=REPO / "heads")
    ap.add_argument("--convs", type=int, default=48)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--dry-run", action="store_true", help="compare only; never write under heads/")
    args = ap.parse_args(argv)
    try:
        candidate = import_head(find_export(args.files_at), args.staging)
    except PartError as e:
        print(f"refused: {e}", file=sys.stderr)
        return 2
    print(f"joined {candidate}; evaluating it and {args.shipped.name} on held-out {', '.join(EVAL_DOMAINS)} ...")
    new, old = evaluate_heads([candidate, args.shipped], args.convs, args.max_len)
    better, reason = decide(new, old)
    record = {"compared_with": args.shipped.name, "shipped_heldout_eval": old, "decision": "replace" if better
              else "keep shipped", "reason": reason, "convs": args.convs, "max_len": args.max_len}
    update_metrics(candidate, {"heldout_eval_cpu": new, "install": record})
    print(("REPLACE: " if better else "KEEP the shipped head: ") + reason)
    if not better or args.dry_run:
        return 0
    dest = args.heads / candidate.name
    if dest.exists():
        print(f"{dest} exists already; not overwritten", file=sys.stderr)
        return 1
    shutil.copytree(candidate, dest)
    print(f"installed {dest}. Point these at it (they name {args.shipped.name}): {', '.join(references(args.shipped.name))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
