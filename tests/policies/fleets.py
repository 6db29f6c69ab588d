"""LocalFleet (test code): a policies.fleet.Fleet over in-process replica objects, for the policy's tests.
It carries the canary out by routing each request with the policy's own decision (policies.canary:
`Canary.takes`, the request id's hash) and records finished requests into the policy's sink
(`LiveSamples`); it owns nothing of the canary itself."""

from __future__ import annotations

import threading
from typing import Protocol, Sequence

from adaptive_eagle.versions import version_label
from policies.canary import Canary, LiveSamples
from policies.fleet import SwapOutcome
from policies.samples import RequestSample


class Replica(Protocol):
    """What LocalFleet needs of a replica (serving's DecodeServer has both)."""

    head_version: str | None  # None or "none": plain decoding

    def swap_head(self, version: str) -> SwapOutcome: ...


class LocalFleet:
    """A Fleet over in-process replicas. Tests call ``route(request_id)`` to learn which version a new
    request decodes with and ``record(sample)`` when it finishes. Thread-safe."""

    def __init__(self, replicas: Sequence[Replica], *, max_samples: int = 100_000,
                 unservable: dict[str, str] | None = None) -> None:
        if not replicas:
            raise ValueError("a fleet needs at least one replica")
        self.replicas = list(replicas)
        self.unservable = dict(unservable or {})  # version -> why the replicas could never serve it
        self.samples = LiveSamples(max_samples)  # bounded per head version
        self._canary: Canary | None = None
        self._lock = threading.Lock()

    # ---- Fleet ------------------------------------------------------------------------------------
    def swap(self, version: str) -> list[SwapOutcome]:
        return [r.swap_head(version) for r in self.replicas]

    def serving_versions(self) -> list[str]:
        return [version_label(r.head_version) for r in self.replicas]

    def set_canary(self, version: str | None, fraction: float) -> None:
        if version is not None and not 0.0 < fraction <= 1.0:
            raise ValueError(f"canary fraction must be in (0, 1], got {fraction}")
        with self._lock:
            self._canary = None if version is None else Canary(version, float(fraction))

    def live_samples(self, version: str, since: float) -> list[RequestSample]:
        return self.samples.get(version, since)

    def cannot_serve(self, version: str) -> str | None:
        return self.unservable.get(version)

    # ---- the serving side -------------------------------------------------------------------------
    @property
    def canary(self) -> Canary | None:
        with self._lock:
            return self._canary

    def route(self, request_id: str) -> str:
        """The version a new request decodes with: the canary's for its share of request ids, else the
        version the first replica serves."""
        canary = self.canary
        if canary is not None and canary.takes(request_id):
            return canary.version
        return self.serving_versions()[0]

    def record(self, sample: RequestSample) -> None:
        """A finished request (the oldest samples of its version fall off past max_samples)."""
        self.samples.add(sample)
