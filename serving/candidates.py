"""CandidateFeed: new heads in the registry, handed to the promotion policy with their replay evidence.

Owns: noticing versions that appeared since the stack started, reading the acceptance replay the
trainer wrote into each candidate's head.json (`metrics.replay.samples.{candidate,champion}`: lists
of [request_id, domain, accept_length]) into `policies.samples.RequestSample` lists, and calling the
policy's `consider` when it is free. Must not touch: the gates (policies/), training (trainer/).

Only the newest waiting candidate matters: one that arrives while the policy is busy (a canary or a
watch) or the registry is pinned waits; a newer one replaces it. A version without replay samples
(added by hand) is never considered automatically.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

from policies.samples import PLAIN, RequestSample

log = logging.getLogger(__name__)


def replay_samples(metrics: dict, candidate: str) -> Optional[tuple[list[RequestSample], list[RequestSample]]]:
    """(champion samples, candidate samples) from a head.json's metrics; None without replay samples."""
    replay = (metrics or {}).get("replay") or {}
    samples = replay.get("samples") or {}
    if not samples.get("candidate"):
        return None
    champion = replay.get("champion_version") or PLAIN

    def rows(key: str, version: str) -> list[RequestSample]:
        return [RequestSample(accept_length=max(1.0, float(a)), head_version=version, domain=d, request_id=str(r))
                for r, d, a in samples.get(key) or ()]

    return rows("champion", champion), rows("candidate", candidate)


def replay_exact(metrics: dict) -> bool:
    """Whether a candidate's replay was exact: every record it was replayed on was greedy (head.json's
    metrics.replay.exact; False when absent). The policy then runs a health canary (policies.controller)."""
    return bool(((metrics or {}).get("replay") or {}).get("exact", False))


class CandidateFeed:
    def __init__(self, registry, known: Optional[set[str]] = None) -> None:
        """known: versions never to consider (default: every version in the registry now)."""
        self.registry = registry
        self.known = set(known) if known is not None else {v.version for v in registry.versions()}
        self.pending: Optional[str] = None
        self.considered: list[tuple[str, str]] = []  # (version, action)

    def scan(self) -> Optional[str]:
        """The newest candidate not seen yet (it replaces an older pending one)."""
        for v in self.registry.versions():  # oldest first
            if v.version in self.known:
                continue
            self.known.add(v.version)
            if replay_samples(v.metrics, v.version) is None:
                log.info("candidate feed: %s has no replay samples; not considered automatically", v.version)
                continue
            if self.pending is not None:
                log.info("candidate feed: %s superseded by %s", self.pending, v.version)
            self.pending = v.version
        return self.pending

    async def step(self, policy) -> Optional[object]:
        """Consider the pending candidate if the policy is idle and nothing is pinned; returns its Decision."""
        if self.scan() is None:
            return None
        status = await policy.status()
        if status.get("state") != "idle" or self.registry.pinned() is not None:
            return None
        version, self.pending = self.pending, None
        metrics = self.registry.version(version).metrics
        champ, cand = replay_samples(metrics, version)
        decision = await policy.consider(version, champ, cand, replay_exact(metrics))
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


__all__ = ["CandidateFeed", "replay_exact", "replay_samples"]
