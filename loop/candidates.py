"""CandidateFeed: new heads in the registry, handed to the promotion policy with their replay evidence.

Owns: noticing versions that appeared since the stack started, converting their evidence (read through the
head format's models, adaptive_eagle.evidence) into `policies.samples.RequestSample` lists, and calling the
policy's `consider` when it is free. Must not touch: the gates (policies/), training (trainer/), the evidence
formats (adaptive_eagle.evidence owns and validates them).

Two kinds of evidence, as the trainer's `evidence` setting writes them (head.json `metrics.replay`,
`ReplayEvidence`):
- test-then-train (`evidence: prequential`): the pairs grow in the candidate's evidence file
  (`CandidateEvidence`) as the trainer replays new records. Every candidate whose evidence is still undecided
  is re-read whenever it grew, and the policy's sequential offline gate judges it, until it decides (or the
  file closes and it decides on what is there).
- held-out (`samples.{candidate,champion}`: one sample per record, with the record's context position since
  the context guard), complete when the candidate is written: only the newest waiting candidate matters; one
  that arrives while the policy is busy (a canary or a watch) or the registry is pinned waits, and a newer one
  replaces it.
A malformed evidence file or replay block is refused with its reason, counted and logged, and the candidate is
not considered again. A version with no evidence (added by hand) is never considered automatically.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

from adaptive_eagle.evidence import CandidateEvidence, EvidenceError, ReplayEvidence, ReplaySample, read_evidence
from policies.samples import RequestSample

log = logging.getLogger(__name__)


def heldout_samples(ev: ReplayEvidence, candidate: str) -> Optional[tuple[list[RequestSample], list[RequestSample]]]:
    """(champion samples, candidate samples) of held-out evidence; None without candidate samples."""
    if not ev.samples.candidate:
        return None

    def requests(samples: list[ReplaySample], version: str) -> list[RequestSample]:
        return [RequestSample(accept_length=s.accept_length, head_version=version, domain=s.domain,
                              request_id=s.request_id, context=s.context) for s in samples]

    return requests(ev.samples.champion, ev.champion_version), requests(ev.samples.candidate, candidate)


def replay_samples(metrics: dict, candidate: str) -> Optional[tuple[list[RequestSample], list[RequestSample]]]:
    """(champion samples, candidate samples) from a head.json's metrics; None without replay samples. A malformed
    replay block is refused (EvidenceError, a ValueError naming the field)."""
    ev = ReplayEvidence.from_metrics(metrics)
    return None if ev is None else heldout_samples(ev, candidate)


def prequential(metrics: dict) -> bool:
    """Whether a candidate's evidence is test-then-train (an evidence file that grows)."""
    ev = ReplayEvidence.from_metrics(metrics)
    return ev is not None and ev.prequential


def evidence_samples(ev: CandidateEvidence) -> tuple[list[RequestSample], list[RequestSample]]:
    """(champion samples, candidate samples) of test-then-train evidence, in arrival order."""
    champ, cand = [], []
    for r, d, a, b, _, *rest in ev.rows:
        context = rest[0] if rest else None  # five-element rows (older files): not sliced by context length
        champ.append(RequestSample(accept_length=a, head_version=ev.champion, domain=d, request_id=r, context=context))
        cand.append(RequestSample(accept_length=b, head_version=ev.version, domain=d, request_id=r, context=context))
    return champ, cand


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
            ev = self._replay(v)
            if ev is not None and ev.prequential:
                self.gathering[v.version] = (-1, True)
                continue
            if ev is None or heldout_samples(ev, v.version) is None:
                if v.version not in self.refused:
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
            ev = ReplayEvidence.from_head_meta(self.registry.version(version))
            champ, cand = heldout_samples(ev, version)
            decision = await policy.consider(version, champ, cand, exact_replay=ev.exact)
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
        """For the loop's metrics: evidence refused (files or head.json blocks), sequential looks, candidates
        gathering."""
        return {"refused": len(self.refused), "looks": self.looks, "gathering": len(self.gathering)}

    def _replay(self, version) -> Optional[ReplayEvidence]:
        """A new version's head.json replay evidence; None without one, or when it is refused (counted, logged)."""
        try:
            return ReplayEvidence.from_head_meta(version)
        except EvidenceError as e:
            self.refused[version.version] = e.reason
            log.error("candidate feed: %s not considered: its replay evidence is refused: %s", version.version, e)
            return None

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


__all__ = ["CandidateFeed", "evidence_samples", "heldout_samples", "prequential", "replay_samples"]
