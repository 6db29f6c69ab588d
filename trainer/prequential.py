"""Test-then-train evidence: every record the trainer reads is first replayed by the champion and by each
candidate snapshot still gathering evidence, and only then trained on. No record is withheld from training,
and a snapshot's evidence comes only from records it never trained on (ones read after it was written, or
waiting in the fresh queue when it was).

Owns: the snapshots gathering evidence (at most `max_pending`: the newest, and of the older ones those whose
rows lead the champion most), replaying a batch of records
with them, appending the pairs to each snapshot's evidence file (adaptive_eagle.evidence, which the policy
re-reads), and closing a file with its reason. Must not touch: the optimizer, the store, the policy.

Cost: one replay of the champion and of each open snapshot per record (the record's hidden states are read
or regenerated once for all of them).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from adaptive_eagle.draft_head import Eagle3DraftHead
from adaptive_eagle.evidence import (EVIDENCE_DIR, CandidateEvidence, EvidenceError, evidence_path, read_evidence,
                                     write_evidence)
from adaptive_eagle.targets import Target
from adaptive_eagle.trace import TraceRecord
from trainer.replay import TreeParams, replay_heads, replay_ready

log = logging.getLogger(__name__)

CHAMPION = "\x00champion"  # the champion's key among the replayed heads (no version name can be this)


@dataclass
class Snapshot:
    version: str
    head: Eagle3DraftHead  # exactly what the registry stores (bf16 round trip), eval mode
    evidence: CandidateEvidence


def lead(evidence: CandidateEvidence) -> float:
    """The mean paired gain in accept length of a snapshot over the champion on its rows so far (0 with none)."""
    return float(np.mean([r[3] - r[2] for r in evidence.rows])) if evidence.rows else 0.0


class EvidenceBook:
    def __init__(self, registry_root: str | Path, tree: TreeParams, *, max_pending: int, max_records: int) -> None:
        self.root = Path(registry_root)
        self.tree, self.max_pending, self.max_records = tree, max_pending, max_records
        self.open: list[Snapshot] = []  # oldest first
        self.recent: deque[TraceRecord] = deque(maxlen=64)  # the last records tested (MoE routing statistics)
        self.rows_written = 0
        self._champion: tuple[Eagle3DraftHead, Eagle3DraftHead] | None = None  # (the trainer's, made ready)
        self.skipped: dict[str, int] = {}

    # ---- snapshots ------------------------------------------------------------------------------------
    def add(self, version: str, head: Eagle3DraftHead, champion: str, recipe: dict) -> None:
        """Start gathering evidence for a snapshot just registered (`head` is handed over: made ready for replay
        in place). Beyond max_pending one older snapshot closes (its evidence stays for the policy to decide on):
        the one whose rows lead the champion least (`lead`; the oldest among equals). So a snapshot that is
        clearly better keeps gathering evidence while newer ones come and go, instead of closing after a fixed
        number of snapshots with too few records to be promoted (the policy's test needs about 60 paired
        records at the demo's settings for a head 50% better, hundreds for a few percent). Which file closes when depends only on rows already
        written, so each snapshot's sequential test stays valid: it may stop at any time."""
        ev = CandidateEvidence(version=version, champion=champion, recipe={"tree": self.tree.__dict__, **recipe})
        self.open.append(Snapshot(version, replay_ready(head, adopt=True), ev))
        while len(self.open) > self.max_pending:
            older = self.open[:-1]
            weakest = min(older, key=lambda snap: (lead(snap.evidence), older.index(snap)))
            self._close(weakest, f"superseded: of the {len(older)} older snapshots gathering evidence its rows lead "
                                 f"the champion least (mean accept length {lead(weakest.evidence):+.3f} over "
                                 f"{len(weakest.evidence.rows)} records; trainer.max_pending_candidates "
                                 f"{self.max_pending})")
        write_evidence(self.root, ev)

    def close_all(self, reason: str) -> None:
        for snap in list(self.open):
            self._close(snap, reason)

    def _close(self, snap: Snapshot, reason: str) -> None:
        snap.evidence.close(reason)
        write_evidence(self.root, snap.evidence)
        self.open.remove(snap)
        log.info("evidence of %s closed after %d records: %s", snap.version, len(snap.evidence.rows), reason)

    def close_orphans(self, reason: str) -> int:
        """Close evidence files left open by an earlier process (their snapshots are not in memory): the policy
        then decides on the rows there are. Returns how many were closed; a malformed file is left as it is
        (the policy refuses it with the reason)."""
        mine = {s.version for s in self.open}
        closed = 0
        for path in sorted((self.root / EVIDENCE_DIR).glob("*.json")):
            version = path.stem
            if version in mine:
                continue
            try:
                ev = read_evidence(self.root, version)
            except EvidenceError as e:
                log.warning("evidence file refused: %s", e)
                continue
            if ev is not None and ev.open:
                ev.close(reason)
                write_evidence(self.root, ev)
                closed += 1
        return closed

    # ---- testing --------------------------------------------------------------------------------------
    def test(self, records: Sequence[TraceRecord], champion: Eagle3DraftHead | None, target: Target | None) -> int:
        """Replay `records` with the champion (None: plain decoding, 1.0 a step) and every open snapshot, and
        append one row per record to each snapshot's evidence. Returns the rows added."""
        self.recent.extend(records)
        if not self.open or not records:
            return 0
        heads = {s.version: s.head for s in self.open}
        if champion is not None:
            if self._champion is None or self._champion[0] is not champion:  # made ready once per champion
                self._champion = (champion, replay_ready(champion))
            heads[CHAMPION] = self._champion[1]
        report = replay_heads(heads, records, target, self.tree)
        for reason, n in report.skipped.items():
            self.skipped[reason] = self.skipped.get(reason, 0) + n
        champ = report.scores.get(CHAMPION)
        greedy = {r.request_id: r.sampling.temperature == 0 for r in records}
        added = 0
        for snap in list(self.open):
            replays = report.scores[snap.version].records
            for i, rep in enumerate(replays):
                if not rep.steps:
                    continue
                base = champ.records[i].accept_length if champ is not None else 1.0
                snap.evidence.add(rep.request_id, rep.domain, max(1.0, base), max(1.0, rep.accept_length),
                                  greedy.get(rep.request_id, False), rep.context)
                added += 1
            if len(snap.evidence.rows) >= self.max_records:
                self._close(snap, f"{self.max_records} records (trainer.candidate_evidence_records)")
            else:
                write_evidence(self.root, snap.evidence)
        self.rows_written += added
        return added

    # ---- what the trainer reports -------------------------------------------------------------------------
    def replay_summary(self) -> dict | None:
        """The candidate side of the snapshot with the most evidence, as ReplayScore.summary() names it (overall
        and per-domain mean accept length), for the MoE growth's low-domain signal."""
        rich = max(self.open, key=lambda s: len(s.evidence.rows), default=None)
        if rich is None or not rich.evidence.rows:
            return None
        rows = rich.evidence.rows
        domains: dict[str, list[float]] = {}
        for _, d, _, cand, *_ in rows:
            domains.setdefault(d or "untagged", []).append(cand)
        return {"accept_length": float(np.mean([r[3] for r in rows])),
                "domains": {d: {"accept_length": float(np.mean(v)), "records": len(v)} for d, v in domains.items()}}

    def status(self) -> list[dict]:
        return [{"version": s.version, "records": len(s.evidence.rows), "greedy": s.evidence.greedy,
                 "path": str(evidence_path(self.root, s.version))} for s in self.open]


__all__ = ["EvidenceBook", "Snapshot"]
