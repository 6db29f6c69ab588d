"""CandidateFeed: new heads in the registry, handed to the promotion policy with their replay evidence.

Owns: noticing versions that appeared since the stack started, reading their evidence into
`policies.samples.RequestSample` lists, and calling the policy's `consider` when it is free. Must not
touch: the gates (policies/), training (trainer/).

Two kinds of evidence, as the trainer's `evidence` setting writes them:
- test-then-train (head.json `metrics.replay.evidence: prequential`): the pairs grow in the candidate's
  evidence file (adaptive_eagle.evidence) as the trainer replays new records. Every candidate whose evidence
  is still undecided is re-read whenever it grew, and the policy's sequential offline gate judges it, until it
  decides (or the file closes and it decides on what is there). A malformed file is refused with its reason,
  counted and logged, and the candidate is not considered again.
- held-out (`metrics.replay.samples.{candidate,champion}`: lists of [request_id, domain, accept_length] and,
  since the context guard, the record's context position as a 4th element), complete when the candidate is
  written: only the newest waiting candidate matters; one that arrives while
  the policy is busy (a canary or a watch) or the registry is pinned waits, and a newer one replaces it.
A version with neither (added by hand) is never considered automatically.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

from adaptive_eagle.evidence import CandidateEvidence, EvidenceError, read_evidence
from adaptive_eagle.versions import PLAIN
from policies.samples import RequestSample

log = logging.getLogger(__name__)


def replay_samples(metrics: dict, candidate: str) -> Optional[tuple[list[RequestSample], list[RequestSample]]]:
    """(champion samples, candidate samples) from a head.json's metrics; None without replay samples."""
    replay = (metrics or {}).get("replay") or {}
    samples = replay.get("samples") or {}
    if not samples.get("candidate"):
        return None
    champion = replay.get("champion_version") or PLAIN

    def rows(key: str, version: str) -> list[RequestSample]:
        return [RequestSample(accept_length=max(1.0, float(row[2])), head_version=version, domain=row[1],
                              request_id=str(row[0]), context=_context(row, key))
                for row in samples.get(key) or ()]

    return rows("champion", champion), rows("candidate", candidate)


def _context(row, key: str) -> Optional[int]:
    """A held-out row's context position: its 4th element (rows written before it existed have 3: None)."""
    if len(row) not in (3, 4):
        raise ValueError(f"replay sample row {row!r} of {key}: [request_id, domain, accept_length] or "
                         "[request_id, domain, accept_length, context_position]")
    return None if len(row) == 3 or row[3] is None else int(row[3])


def prequential(metrics: dict) -> bool:
    """Whether a candidate's evidence is test-then-train (an evidence file that grows)."""
    return ((metrics or {}).get("replay") or {}).get("evidence") == "prequential"


def evidence_samples(ev: CandidateEvidence) -> tuple[list[RequestSample], list[RequestSample]]:
    """(champion samples, candidate samples) of test-then-train evidence, in arrival order."""
    champ, cand = [], []
    for r, d, a, b, _, *rest in ev.rows:
        context = rest[0] if rest else None  # five-element rows (older files): not sliced by context length
        champ.append(RequestSample(accept_length=a, head_version=ev.champion, domain=d, request_id=r, context=context))
        cand.append(RequestSample(accept_length=b, head_version=ev.version, domain=d, request_id=r, context=context))
    return champ, cand


def replay_exact(metrics: dict) -> bool:
    """Whether a candidate's replay was exact: every record it was replayed on was greedy (head.json's
    metrics.replay.exact; False when absent). The policy then runs a health canary (policies.controller)."""
    return bool(((metrics or {}).get("replay") or {}).get("exact", False))


class CandidateFeed:
    def __init__(self, registry, known: Optional[set[str]] = None) -> None:
        """known: versions never to consider (default: every version in the registry now)."""
        self.registry = registry
        self.known = set(known) if known is not None else {v.version for v in registry.versions()}
        self.pending: Optional[str] = None  # held-out evidence: the newest candidate waiting
        self.gathering: dict[str, tuple[int, bool]] = {}  # test-then-train: version -> (rows, open) last judged
        self.considered: list[tuple[str, str]] = []  # (version, action)
        self.refused: dict[str, str] = {}  # version -> why its evidence file was refused
        self.looks = 0  # sequential looks at growing evidence

    def scan(self) -> Optional[str]:
        """The newest held-out candidate not seen yet (it replaces an older pending one); test-then-train
        candidates join `gathering`."""
        for v in self.registry.versions():  # oldest first
            if v.version in self.known:
                continue
            self.known.add(v.version)
            if prequential(v.metrics):
                self.gathering[v.version] = (-1, True)
                continue
            if replay_samples(v.metrics, v.version) is None:
                log.info("candidate feed: %s has no replay samples; not considered automatically", v.version)
                continue
            if self.pending is not None:
                log.info("candidate feed: %s superseded by %s", self.pending, v.version)
            self.pending = v.version
        return self.pending

    async def step(self, policy) -> Optional[object]:
        """Consider the pending candidate, or every test-then-train candidate whose evidence grew, if the policy
        is idle and nothing is pinned; returns the last decision taken (None: nothing was looked at)."""
        self.scan()
        if self.pending is None and not self.gathering:
            return None
        status = await policy.status()
        if status.get("state") != "idle" or self.registry.pinned() is not None:
            return None
        if self.pending is not None:
            version, self.pending = self.pending, None
            metrics = self.registry.version(version).metrics
            champ, cand = replay_samples(metrics, version)
            decision = await policy.consider(version, champ, cand, exact_replay=replay_exact(metrics))
            return self._decided(version, decision)
        decision = None
        for version in sorted(self.gathering):  # names carry the write time: oldest first
            ev = self._read(version)
            if ev is None or (len(ev.rows), ev.open) == self.gathering.get(version):
                continue
            self.gathering[version] = (len(ev.rows), ev.open)
            champ, cand = evidence_samples(ev)
            self.looks += 1
            decision = await policy.consider(version, champ, cand, exact_replay=ev.exact, sequential=True,
                                           final=not ev.open)
            if decision.action != "continue":
                self.gathering.pop(version, None)
                self._decided(version, decision)
            if decision.action == "promote":  # a canary runs: the others wait for the policy to be idle again
                break
        return decision

    def counts(self) -> dict:
        """For the loop's metrics: evidence files refused, sequential looks, candidates gathering."""
        return {"refused": len(self.refused), "looks": self.looks, "gathering": len(self.gathering)}

    def _read(self, version: str) -> Optional[CandidateEvidence]:
        try:
            return read_evidence(self.registry.root, version)
        except EvidenceError as e:
            self.gathering.pop(version, None)
            self.refused[version] = e.reason
            log.error("candidate feed: %s not considered: its evidence file is refused: %s", version, e)
            return None

    def _decided(self, version: str, decision) -> object:
        self.considered.append((version, decision.action))
        log.info("candidate feed: %s considered: %s (%s)", version, decision.action, decision.reason)
        return decision

    async def run(self, policy, interval_s: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.step(policy)
            except Exception:  # noqa: BLE001 - logged; the next scan tries again
                log.exception("candidate feed step failed")
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except asyncio.TimeoutError:
                pass


__all__ = ["CandidateFeed", "evidence_samples", "prequential", "replay_exact", "replay_samples"]
