"""Continual adaptation: many drifts through the whole loop, returns to earlier domains, dense vs MoE heads.

Each run is one `adaptive-eagle demo` (a subprocess, started as a user starts it): the real SmolLM2-135M target
serves ShareGPT traffic through the gateway with the official openai client, every request captured, the
near-line trainer adapting the head, the policy gating promotions, the frozen shipped head replayed on the same
requests and decoding its holdback share of them live. The scenario is a sequence of phases, one domain each,
that drifts and comes back (default: english, code, math, tools (an agent loop calling tools), english, code:
six phases over four domains, two returns). One run per head kind (`--heads dense,moe`): the dense head (the
default trainer) and the MoE-routed head whose trainer grows an expert for a domain that stays low, with the
same minutes, prompts (seed) and CPU budget, one after the other on an otherwise idle machine.

Per phase (adaptive_eagle_cli/demo/phases.py says how each is measured): accept length of the served heads vs
the frozen head on the same requests (gain_pct), time per output token (tpot_gain, holdback arm), the time
from the phase's start to the first promotion that helped it, and on a returning domain the share of its best
gain it lost (forgetting_pct), each with its 90% interval over requests (the time to promotion's from re-running
the gate's test on resamples of the records it promoted on), and how much faster it was re-adapted than the first
time (readapt_speedup = the first phase's time to promotion over this one's: a ratio of the two, whose own
intervals say how far to trust it).

Held out. The configuration these runs use is the shipped default (the demo's), chosen before this bench
existed: no setting was chosen on these phases, so every phase is reported as held out (`heldout`). A session
that tunes a setting with this bench runs it with another `--seed` (other prompts) as its validation run and
reports the default seed's run.

Prints one JSON line: {"bench": "continual", "scenario", "minutes", "seed", "runs": {kind: {"phases": [...],
"goals": {...}, "promotions", "failed_requests", "exit_code", "report"}}}. The goals are the issue's: every
drifted phase +10% accept length over the frozen head, no returning domain losing more than 1% of its best,
returns re-adapted at least twice as fast. `--quick`: a smoke run (4 phases, 3 domains, the demo's quick
settings; about 12 minutes a head kind). Results: each run's demo report under --out/<kind>/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SCENARIO = "english,code,math,tools,english,code"
QUICK_SCENARIO = "english,code,math,english"
GAIN_GOAL_PCT, FORGET_GOAL_PCT, READAPT_GOAL = 10.0, 1.0, 2.0


def readapt(phases: list[dict]) -> list[dict]:
    """Each returning phase's re-adaptation speed-up: the domain's first phase's time to a helping promotion over
    this phase's (None when either had none)."""
    first: dict[str, Optional[float]] = {}
    out = []
    for p in phases:
        p = dict(p, heldout=True, readapt_speedup=None)
        if not p["returning"]:
            first.setdefault(p["domain"], p["time_to_promotion_s"])
        elif first.get(p["domain"]) and p["time_to_promotion_s"]:
            p["readapt_speedup"] = round(first[p["domain"]] / p["time_to_promotion_s"], 2)
        out.append(p)
    return out


def goals(phases: list[dict]) -> dict:
    """The continual goals over the held-out phases: True / False where every phase it concerns has its figure,
    None where some has none (too few requests, no promotion): then the run cannot say."""
    def verdict(values: list) -> Optional[bool]:
        return None if not values or any(v is None for v in values) else all(values)

    drifted = [p for p in phases if p["drifted"] and p["heldout"]]
    returning = [p for p in phases if p["returning"] and p["heldout"]]
    if phases and not any(p["promotions"] for p in phases):  # the frozen head served throughout: nothing to judge
        return {"drifted_gain_at_least_10pct": False if drifted else None, "returning_forgets_at_most_1pct": None,
                "returns_readapt_2x_faster": None, "why": "no promotion in the run: the shipped head served every "
                                                          "phase (no gain, and nothing learnt to forget)"}
    return {
        "drifted_gain_at_least_10pct": verdict([None if p["gain_pct"] is None else p["gain_pct"] >= GAIN_GOAL_PCT
                                               for p in drifted]),
        "returning_forgets_at_most_1pct": verdict([None if p["forgetting_pct"] is None
                                                  else p["forgetting_pct"] <= FORGET_GOAL_PCT for p in returning]),
        "returns_readapt_2x_faster": verdict([None if p["readapt_speedup"] is None
                                             else p["readapt_speedup"] >= READAPT_GOAL for p in returning]),
    }


def run_one(kind: str, args, out: Path) -> dict:
    """One demo run with head kind `kind`; its summary's phase figures and what the goals say of them."""
    cmd = [sys.executable, "-m", "adaptive_eagle_cli", "demo", "--scenario", args.scenario, "--minutes",
           str(args.minutes), "--head", kind, "--seed", str(args.seed), "--out", str(out),
           "--first-phase-share", str(round(1 / len(args.scenario.split(",")), 4))] + (["--quick"] if args.quick else [])
    print(f"[continual] {kind}: {' '.join(cmd[2:])}", flush=True)
    summary_path = out / "summary.json"
    summary_path.unlink(missing_ok=True)  # an earlier run's summary in --out must never stand for this run
    t = time.monotonic()
    with subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}) as proc:
        for line in proc.stdout:  # the demo's progress, prefixed (a long run shows where it is)
            print(f"[{kind}] {line.rstrip()}", flush=True)
    if not summary_path.is_file():
        return {"exit_code": proc.returncode, "error": "the demo wrote no summary.json (see its output above)",
                "report": str(out)}
    s = json.loads(summary_path.read_text())
    phases = readapt(s.get("phase_figures") or [])
    return {"phases": phases, "goals": goals(phases), "promotions": s.get("promotions"),
            "rollbacks": s.get("rollbacks"), "requests": s.get("requests"), "failed_requests": s.get("failed_requests"),
            "greedy_mismatches": (s.get("greedy_checks") or {}).get("mismatches"), "exit_code": proc.returncode,
            "wall_s": round(time.monotonic() - t, 1), "report": str(out / "report.md")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default=None, help=f"phases' domains (default {DEFAULT_SCENARIO}; --quick "
                    f"{QUICK_SCENARIO})")
    ap.add_argument("--minutes", type=float, default=None, help="wall minutes of each run, start-up and report "
                    "included (default 90: about 8 minutes of traffic a phase on 2 cores; --quick 12)")
    ap.add_argument("--heads", default="dense", help="head kinds, one run each, in order: dense, moe (default dense)")
    ap.add_argument("--seed", type=int, default=0, help="prompt order (a validation run uses another seed)")
    ap.add_argument("--out", type=Path, default=Path("continual-report"), help="reports: --out/<head kind>/")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 4 phases over 3 domains, short answers")
    args = ap.parse_args(argv)
    args.scenario = args.scenario or (QUICK_SCENARIO if args.quick else DEFAULT_SCENARIO)
    args.minutes = args.minutes or (12.0 if args.quick else 90.0)
    kinds = [k.strip() for k in args.heads.split(",") if k.strip()]
    if not kinds or any(k not in ("dense", "moe") for k in kinds):
        ap.error(f"--heads: a comma-separated list of dense, moe (got {args.heads!r})")
    runs = {k: run_one(k, args, args.out / k) for k in kinds}
    line = {"bench": "continual", "scenario": args.scenario.split(","), "minutes": args.minutes, "seed": args.seed,
            "quick": args.quick, "machine": f"{os.cpu_count()} CPU cores", "runs": runs}
    print(json.dumps(line), flush=True)
    return max((r.get("exit_code") or 0 for r in runs.values()), default=0)


if __name__ == "__main__":
    sys.exit(main())
