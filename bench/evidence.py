"""Held-out versus test-then-train evidence on the same captured traffic: which candidates the offline gate
passes, and how soon after the drift.

Traffic. Every record of a store, in capture order: a demo's (`adaptive-eagle demo --keep-state`, then
`--store <state dir>/store`) or any store of greedy traffic. The drift is the first record of another domain
than the first record's (or `--drift-domain`).

Two near-line trainers (trainer/nearline.py) start from the same champion (the shipped head, or `--head`)
and see the records one at a time, as they arrived, with the same training budget per record (`--tokens-per-
record`, the trained tokens a record bought in the demo's run on 2 CPU cores) and the same candidate cadence
(`--candidate-tokens` trained tokens). They differ only in `trainer.evidence`:
  heldout      25% of the records (by request id) are never trained on; a candidate is replayed on them when
               written (from 20 held-out records on) and judged once by the bootstrap offline gate;
  prequential  nothing is held out; every record is replayed by the champion and the open snapshots before
               it is trained on, and the sequential offline gate judges each snapshot's evidence after every
               record.
After every record the stack's own candidate feed (loop/candidates.py) reads what the trainer wrote and
hands it to the gates, as it does for the policy.
The policy is the demo's (tail: mean accept length of the lowest 25%, level 90%, 20 records minimum). No
canary runs: a pass here is what would start one.

Prints each mode's decisions (record index, seconds after the drift by capture time) and ends with one JSON
line: per mode the candidates written, the gate's decisions, the first pass (`first_pass_record`,
`first_pass_after_drift_s`), records trained; and `sooner_s`, heldout's first pass minus prequential's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from adaptive_eagle.cli import SHIPPED_HEAD  # noqa: E402
from adaptive_eagle.registry import HeadRegistry  # noqa: E402
from adaptive_eagle.targets import load_target  # noqa: E402
from feature_store.config import StoreConfig  # noqa: E402
from feature_store.reader import RecordFilter, scan_records  # noqa: E402
from feature_store.writer import write_records  # noqa: E402
from policies.gates import CONTINUE, PROMOTE, offline_gate, sequential_offline_gate  # noqa: E402
from loop.candidates import CandidateFeed  # noqa: E402
from trainer.config import NearlineConfig  # noqa: E402
from trainer.nearline import NearlineTrainer  # noqa: E402


def demo_policy():
    """The demo's gates (adaptive_eagle_cli/demo/config.py), so the comparison judges as the demo does."""
    from adaptive_eagle_cli.demo.config import DemoConfig, demo_stack_config

    with tempfile.TemporaryDirectory() as d:
        return demo_stack_config(DemoConfig.make(), d).policy.gates()


class GateOnly:
    """The two calls the stack's candidate feed makes of the policy, answered by the gates alone: always idle,
    no canary (a pass here is what would start one). Keeps each decision's reason."""

    def __init__(self, config) -> None:
        self.config, self.reasons = config, {}

    async def status(self) -> dict:
        return {"state": "idle"}

    async def consider(self, version, champion, candidate, exact_replay=False, sequential=False, final=False):
        d = (sequential_offline_gate(champion, candidate, self.config, final=final) if sequential
             else offline_gate(champion, candidate, self.config))
        if d.action != CONTINUE:
            self.reasons[version] = d.reason
        return d


def run_mode(mode: str, records: list, target, head_dir: Path, work: Path, drift_at: float, args, policy,
             log) -> dict:
    root = work / mode
    reg = HeadRegistry.create(root / "registry")
    champion = reg.add(head_dir)
    reg.set_champion(champion, expect="none")
    store = StoreConfig(backend="local", local_root=str(root / "store"), fsync=False)
    cfg = NearlineConfig(registry=str(root / "registry"), work_dir=str(root / "trainer"), store=store, device="cpu",
                         evidence=mode, heldout_percent=25, heldout_per_domain=48, min_candidate_heldout=20,
                         batch_tokens=4096, min_fresh_tokens=1024, max_len=768, positions="generated",
                         candidate_every_tokens=args.candidate_tokens, candidate_every_minutes=1e9,
                         min_candidate_tokens=min(8192, args.candidate_tokens), checkpoint_every_s=1e9,
                         max_pending_candidates=2, candidate_evidence_records=policy.offline_max_samples)
    tr = NearlineTrainer(cfg, target=target)
    tr.start()
    feed, gate = CandidateFeed(reg), GateOnly(policy)  # the stack's feed: what it reads, when it looks
    budget, decisions = 0.0, []
    t0 = time.perf_counter()
    for i, rec in enumerate(records):
        write_records(store, [rec])
        tr.poll()
        budget += args.tokens_per_record
        while budget > 0 and tr.ready() is not None:
            if tr.train_once() is None:
                break
            budget -= tr.last_batch["tokens"]
        budget = min(budget, 0.0) if tr.ready() is None else budget  # idle time is not banked
        if tr.candidate_due():
            tr.write_candidate()
        seen = len(feed.considered)
        asyncio.run(feed.step(gate))
        for version, action in feed.considered[seen:]:
            after = round(rec.created_at - drift_at, 1)
            decisions.append({"candidate": version, "action": action, "record": i, "after_drift_s": after})
            log(f"  [{mode}] record {i} ({after:+.0f} s from the drift): {version} {action}: "
                f"{gate.reasons.get(version, '')[:150]}")
    passes = [d for d in decisions if d["action"] == PROMOTE]
    first = passes[0] if passes else None
    out = {"candidates": len(tr.counters["candidates"]), "records_trained": tr.counters["records_trained"],
           "decisions": [{k: d[k] for k in ("candidate", "action", "record", "after_drift_s")} for d in decisions],
           "first_pass_record": first["record"] if first else None,
           "first_pass_after_drift_s": first["after_drift_s"] if first else None,
           "seconds": round(time.perf_counter() - t0, 1)}
    tr.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store", required=True, type=Path, help="a local store directory (a demo's <state>/store)")
    ap.add_argument("--head", type=Path, default=SHIPPED_HEAD, help="the champion both trainers start from")
    ap.add_argument("--drift-domain", default=None, help="domain whose first record is the drift (default: the "
                    "first record of another domain than the first record's)")
    ap.add_argument("--tokens-per-record", type=float, default=570.0, help="trained tokens each arriving record "
                    "buys (the demo on 2 CPU cores: ~85k tokens over ~150 records)")
    ap.add_argument("--candidate-tokens", type=int, default=12_000, help="trained tokens between candidates (the "
                    "demo's one a minute at ~200 tokens/s)")
    ap.add_argument("--modes", default="heldout,prequential")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON line to this file")
    args = ap.parse_args()
    if not (args.store / "segments").is_dir():
        ap.error(f"--store {args.store}: not a local store (no segments/ directory)")
    store = StoreConfig(backend="local", local_root=str(args.store), fsync=False)
    scan = scan_records(store, RecordFilter())
    records, unreadable = scan.records, scan.unreadable
    records.sort(key=lambda r: r.created_at)
    if not records:
        ap.error(f"--store {args.store}: no records")
    first_domain = records[0].domain
    drift = next((r for r in records if (r.domain == args.drift_domain if args.drift_domain else
                                         r.domain != first_domain)), None)
    if drift is None:
        ap.error("no drift in the store: every record has the first record's domain (see --drift-domain)")
    drift_at = drift.created_at
    policy = demo_policy()
    print(f"{len(records)} records ({unreadable} unreadable), drift to {drift.domain} at record "
          f"{records.index(drift)}; policy: tail {policy.tail_statistic} q {policy.tail_quantile}, level "
          f"{policy.confidence_level}, min_samples {policy.min_samples}", flush=True)
    target = load_target("smollm2-135m", purpose="train")
    result: dict = {"records": len(records), "drift_record": records.index(drift), "drift_domain": drift.domain,
                    "tokens_per_record": args.tokens_per_record, "candidate_tokens": args.candidate_tokens}
    with tempfile.TemporaryDirectory() as d:
        for mode in args.modes.split(","):
            print(f"{mode} ...", flush=True)
            result[mode] = run_mode(mode, records, target, args.head, Path(d), drift_at, args, policy,
                                    lambda line: print(line, flush=True))
    h, p = result.get("heldout", {}), result.get("prequential", {})
    if h.get("first_pass_after_drift_s") is not None and p.get("first_pass_after_drift_s") is not None:
        result["sooner_s"] = round(h["first_pass_after_drift_s"] - p["first_pass_after_drift_s"], 1)
    line = json.dumps(result)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")


if __name__ == "__main__":
    main()
