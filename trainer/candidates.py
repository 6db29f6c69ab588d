"""Candidates: when the near-line trainer proposes its head to the registry, and what a proposal carries.

Owns: the cadence (a candidate after candidate_every_tokens trained tokens or candidate_every_minutes, never
with fewer than min_candidate_tokens, and with evidence "heldout" never before min_candidate_heldout
held-out records can score it); the candidate itself (the head as the registry stores it, bf16-rounded) and
its name; its evidence when written (evidence "heldout": the acceptance replay of candidate and champion on
the same held-out records; "prequential": a snapshot handed to the EvidenceBook, which gathers its
test-then-train evidence from then on); its training facts, the window of traffic it learnt from and its
trainer latency (capture to candidate, by stage: `candidate_latency`).

Must not touch: the store, the optimizer, the state on disk, the champion (the policy decides what serves;
the trainer only proposes), the evidence files (trainer/prequential.py writes them).
"""

from __future__ import annotations

import copy
import time
from typing import Callable

import numpy as np
import torch

from adaptive_eagle.checkpoint import HeadMeta
from adaptive_eagle.draft_head import Eagle3DraftHead
from adaptive_eagle.registry import HeadRegistry
from adaptive_eagle.targets import Target
from adaptive_eagle.trace import TraceRecord
from adaptive_eagle.versions import PLAIN
from trainer.config import NearlineConfig
from trainer.moe import MoEGrowth, candidate_meta
from trainer.prequential import EvidenceBook
from trainer.replay import ReplayScore, prequential_metrics, replay_heads, replay_metrics


def greedy_records(score: ReplayScore, records: list[TraceRecord]) -> int:
    """How many of the records a score replayed were greedy (temperature 0): their replay is exact."""
    replayed = {r.request_id for r in score.records}
    return sum(1 for r in records if r.request_id in replayed and r.sampling.temperature == 0)


def candidate_latency(trained: list[tuple[float, float, float]], eval_started: float, written: float) -> dict | None:
    """Trainer latency of a candidate: for each record it is the first candidate to have trained on (captured,
    read by the trainer, trained: unix seconds), the time from its capture to the candidate being written, and
    the medians of the stages it went through: capture to the trainer (the store and the poll), queued (waiting
    for a batch's worth of fresh tokens or for requests to drain), trained to evaluation (the candidate
    cadence), evaluation (replaying candidate and champion). None when no fresh record was trained."""
    if not trained:
        return None
    captured, read, stepped = (np.asarray(c, dtype=float) for c in zip(*trained))
    total = written - captured

    def r(x: float) -> float:
        return round(float(x), 1)

    return {"records": len(trained), "capture_to_candidate_p50": r(np.median(total)),
            "capture_to_candidate_min": r(total.min()), "capture_to_candidate_max": r(total.max()),
            "stages_p50": {"capture_to_trainer": r(np.median(read - captured)), "queued": r(np.median(stepped - read)),
                           "trained_to_evaluation": r(np.median(eval_started - stepped)),
                           "evaluation": r(written - eval_started)}}


def describe_latency(latency: dict) -> str:
    """One line: the capture-to-candidate time of a candidate's records and where the median went."""
    st = latency["stages_p50"]
    return (f"its {latency['records']} new records were captured {latency['capture_to_candidate_min']:.0f}-"
            f"{latency['capture_to_candidate_max']:.0f} s before (median {latency['capture_to_candidate_p50']:.0f} s: "
            f"{st['capture_to_trainer']:.0f} s to the trainer, {st['queued']:.0f} s queued, "
            f"{st['trained_to_evaluation']:.0f} s to the candidate's evaluation, {st['evaluation']:.0f} s evaluating)")


def widen_window(window: dict | None, rec: TraceRecord) -> dict:
    """The trained-traffic window (first and last created_at, records per domain) with `rec` in it."""
    w = window or {"first": rec.created_at, "last": rec.created_at, "domains": {}}
    w["first"], w["last"] = min(w["first"], rec.created_at), max(w["last"], rec.created_at)
    w["domains"][rec.domain or "untagged"] = w["domains"].get(rec.domain or "untagged", 0) + 1
    return w


class CandidateWriter:
    """Proposes the trainer's head as candidate versions. `counters` is the trainer's counters dict (shared,
    reset in place): this role reads steps, tokens_trained and records_trained, and adds window and candidates."""

    def __init__(self, cfg: NearlineConfig, registry: HeadRegistry, book: EvidenceBook, counters: dict,
                 note: Callable[[str], None]) -> None:
        self.cfg, self.registry, self.book, self.counters, self._note = cfg, registry, book, counters, note
        self.tokens_at_candidate = 0  # tokens_trained when the last candidate was written (checkpointed)
        self.last_t = time.monotonic()  # when the last candidate was written (or training restarted)
        # for the records trained since the last candidate, (captured, read, trained) unix seconds; a candidate
        # reports the spread
        self.trained_times: list[tuple[float, float, float]] = []
        self.last_latency: dict | None = None

    @property
    def prequential(self) -> bool:
        return self.cfg.evidence == "prequential"

    def restart(self) -> None:
        """A new head from a champion: the cadence starts again, and what the old head trained on is not in it."""
        self.tokens_at_candidate = 0
        self.last_t = time.monotonic()
        self.trained_times = []

    def due_now(self) -> None:
        """The next candidate is due as soon as min_candidate_tokens allow (the champion moved under the line)."""
        self.last_t = time.monotonic() - 60 * self.cfg.candidate_every_minutes

    def trained(self, records: list[TraceRecord], times: list[tuple[float, float, float]]) -> None:
        """Fresh records a step trained on, with their (captured, read, trained) times: the next candidate's
        latency and the window it learnt from."""
        self.trained_times.extend(times)
        for rec in records:
            self.counters["window"] = widen_window(self.counters["window"], rec)

    def due(self, has_head: bool, heldout: int) -> bool:
        """A candidate now? `heldout`: the held-out records that could score it."""
        trained = self.counters["tokens_trained"] - self.tokens_at_candidate
        if not has_head or trained < self.cfg.min_candidate_tokens:
            return False
        if not self.prequential and heldout < self.cfg.min_candidate_heldout:
            return False
        minutes = (time.monotonic() - self.last_t) / 60
        return trained >= self.cfg.candidate_every_tokens or minutes >= self.cfg.candidate_every_minutes

    def evaluate(self, head: Eagle3DraftHead, champion_head: Eagle3DraftHead | None, records: list[TraceRecord],
                 target: Target) -> tuple[ReplayScore, ReplayScore | None, dict]:
        """Replay `head` and the champion (None: plain decoding) on the same held-out records."""
        heads = {"candidate": head}
        if champion_head is not None:
            heads["champion"] = champion_head
        report = replay_heads(heads, records, target, self.cfg.tree)
        return report.scores["candidate"], report.scores.get("champion"), report.skipped

    def write(self, head: Eagle3DraftHead, *, base: str, champion_head: Eagle3DraftHead | None,
              heldout: list[TraceRecord], target: Target, moe: MoEGrowth | None) -> str:
        """Register a copy of `head` (already level with any workers') as a candidate of champion `base`.
        Evidence "heldout": with its replay scores next to the champion's on the `heldout` records.
        "prequential": as a snapshot that gathers its evidence from the records read from now on (and those
        still waiting for a step), which the policy re-reads."""
        cand = copy.deepcopy(head).to(torch.bfloat16).float().eval()  # exactly what the registry stores
        t_eval = time.time()
        if self.prequential:
            replay = prequential_metrics(base, self.cfg.tree)
            records = list(self.book.recent)
            if moe is not None and (summary := self.book.replay_summary()) is not None:
                moe.note_replay(summary)
        else:
            score, champ, skipped = self.evaluate(cand, champion_head, heldout, target)
            records = heldout
            replay = replay_metrics(score, champ, base, self.cfg.tree, skipped, greedy_records(score, records))
            if moe is not None:
                moe.note_replay(score.summary())
        latency = candidate_latency(self.trained_times, t_eval, time.time())
        name = self._name()
        moe_training, moe_metrics = candidate_meta(cand, target, records, moe)
        training = {"trainer": "nearline", "steps": self.counters["steps"], "tokens": self.counters["tokens_trained"],
                    "lr": self.cfg.lr, "positions": self.cfg.positions, "replay_ratio": self.cfg.replay_ratio,
                    **moe_training}
        meta = HeadMeta.new(name, target.name, target.fingerprint, parent=None if base == PLAIN else base,
                            data={"source": "captured traffic", "window": self.counters["window"],
                                  "records_trained": self.counters["records_trained"], "latency_s": latency},
                            training=training, metrics={"replay": replay, **moe_metrics})
        self.registry.register(cand, meta)
        if self.prequential:
            self.book.add(name, cand, base, {"steps": training["steps"], "tokens": training["tokens"],
                                             "records_trained": self.counters["records_trained"]})
        self.counters["candidates"].append(name)
        self.tokens_at_candidate = self.counters["tokens_trained"]
        self.last_t = time.monotonic()
        self.trained_times = []
        self.last_latency = latency
        if self.prequential:
            judged = f"snapshot gathering test-then-train evidence against {base} ({len(self.book.open)} open)"
        else:
            gain = f" vs champion {champ.mean:.3f}" if champ is not None else " vs plain decoding 1.000"
            judged = f"replayed accept length {score.mean:.3f}{gain} on {len(score.records)} records"
        self._note(f"candidate {name}: {judged}" + (f"; {describe_latency(latency)}" if latency else ""))
        return name

    def _name(self) -> str:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        name, k = f"{self.cfg.candidate_prefix}-{stamp}", 1
        while name in self.registry:
            k += 1
            name = f"{self.cfg.candidate_prefix}-{stamp}-{k}"
        return name


__all__ = ["CandidateWriter", "candidate_latency", "describe_latency", "greedy_records", "widen_window"]
