"""The canary, owned by the policy: which share of new requests goes to the candidate, which requests
those are, and the live samples the gates judge it by.

Owns: ``Canary`` (the record of the canary in progress: the candidate version and its share of new
requests), the per-request decision (``unit_hash`` of the request id below the share, ``Canary.takes``;
or a uniform draw below the share, ``Canary.takes_draw``, for a router that draws at random), and
``LiveSamples`` (the bounded, thread-safe sink of finished requests per head version that a fleet's
``live_samples`` reads). Plain Python. Must not touch: torch, Ray, serving, the trainer, the store; how a
fleet carries a canary out (routing requests, swapping some replicas, a candidate prepared inside one
replica) belongs to the fleet, which calls this module.

Vocabulary: the *candidate* is the head version under test; the *champion* keeps every other request.
A request id always hashes to the same number in [0, 1), so the same request always takes the same head.
"""

from __future__ import annotations

import threading
import zlib
from collections import deque
from dataclasses import dataclass

from policies.samples import RequestSample


def unit_hash(request_id: str) -> float:
    """A stable number in [0, 1) for a request id (CRC-32 of its UTF-8 bytes over 2**32): the canary takes
    the ids below its share. Never change it: the same id must route the same way in every process."""
    return zlib.crc32(request_id.encode()) / 2**32


@dataclass(frozen=True)
class Canary:
    """The canary in progress: `version` decodes `fraction` of new requests."""

    version: str  # the candidate head (a registry version)
    fraction: float  # share of new requests, in [0, 1]

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"canary fraction must be in [0, 1], got {self.fraction}")

    def takes(self, request_id: str) -> bool:
        """Whether the request with this id decodes with the candidate (stable: the same id, the same answer)."""
        return self.takes_draw(unit_hash(request_id))

    def takes_draw(self, u: float) -> bool:
        """Whether a request with the number `u` in [0, 1) (its id's hash, or a uniform draw) goes to the candidate."""
        return u < self.fraction

    def to_json(self) -> dict:
        return {"version": self.version, "fraction": self.fraction}


class LiveSamples:
    """Finished requests per head version, newest last, the oldest falling off past `max_per_version` per
    version. Thread-safe: servers record from their own threads while the policy reads."""

    def __init__(self, max_per_version: int = 20_000) -> None:
        if max_per_version < 1:
            raise ValueError(f"max_per_version must be >= 1, got {max_per_version}")
        self.max = max_per_version
        self._by_version: dict[str, deque[RequestSample]] = {}
        self._lock = threading.Lock()

    def add(self, sample: RequestSample) -> None:
        with self._lock:
            self._by_version.setdefault(sample.head_version, deque(maxlen=self.max)).append(sample)

    def get(self, version: str, since: float = 0.0) -> list[RequestSample]:
        """The samples of `version` that finished at or after `since` (unix seconds), oldest first."""
        with self._lock:
            return [s for s in self._by_version.get(version, ()) if s.finished_at >= since]


__all__ = ["Canary", "LiveSamples", "unit_hash"]
