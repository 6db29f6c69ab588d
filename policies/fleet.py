"""The fleet as the policy sees it: a small protocol (swap every replica, read what each serves, route a
canary, read live samples) and LocalFleet, an in-process implementation over replica objects.

Owns: the ``Fleet`` protocol the controller drives, and ``LocalFleet``. Must not touch: how a replica
decodes or installs a head (``serving``, ``engine.set_head``), torch, Ray, the registry. The serving
package provides its own Fleet (gateway-backed) with the same four methods.

Vocabulary: a *replica* is one server; its *version* is the head version it confirms it serves ("none":
plain decoding). A *canary* sends a fraction of new requests to a candidate version while the rest keep
the fleet's version (by routing requests, or by swapping some replicas: then ``serving_versions`` is mixed
during the canary); outside a canary every replica serves the same version.
"""

from __future__ import annotations

import threading
import zlib
from collections import deque
from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

from adaptive_eagle.versions import version_label

from policies.samples import RequestSample


@runtime_checkable
class SwapOutcome(Protocol):
    """What one replica's ``swap_head`` returned (``adaptive_eagle.binding.SwapResult`` has these)."""

    ok: bool  # the replica serves `version` now; False: it refused and keeps its old head
    message: str  # why, when refused
    version: str | None  # the version the replica serves after the call (None or "none": plain decoding)


@runtime_checkable
class Fleet(Protocol):
    """Every replica of one model, as the policy drives it."""

    def swap(self, version: str) -> list[SwapOutcome]:
        """Hot-swap every replica to `version` ("none": plain decoding); one outcome per replica, in replica
        order. A refused swap leaves that replica on its old head. Never raises for a refusal."""
        ...

    def serving_versions(self) -> list[str]:
        """Each replica's confirmed version, in replica order ("none" for plain decoding)."""
        ...

    def set_canary(self, version: str | None, fraction: float) -> object:
        """Send `fraction` of new requests to `version` (None: end the canary; fraction is then ignored).
        A fleet may route per request (LocalFleet) or swap some replicas to `version` (the gateway's); the
        return value is ignored. Raises (ValueError, RuntimeError, ...) when the canary cannot be set."""
        ...

    def live_samples(self, version: str, since: float) -> list[RequestSample]:
        """Finished requests that decoded with `version` and finished at or after `since` (unix seconds)."""
        ...


class Replica(Protocol):
    """What LocalFleet needs of a replica (serving's DecodeServer has both)."""

    head_version: str | None  # None or "none": plain decoding

    def swap_head(self, version: str) -> SwapOutcome: ...


@dataclass(frozen=True)
class Canary:
    version: str
    fraction: float  # of new requests, in (0, 1]


def _unit_hash(key: str) -> float:
    """A stable number in [0, 1) for a request id (the same request always routes the same way)."""
    return zlib.crc32(key.encode()) / 2**32


class LocalFleet:
    """A Fleet over in-process replicas, with its own canary routing and a bounded sample sink.

    Servers (or tests) call ``route(request_id)`` to learn which version a new request decodes with and
    ``record(sample)`` when it finishes. Thread-safe: replicas may record from their own threads."""

    def __init__(self, replicas: Sequence[Replica], *, max_samples: int = 100_000) -> None:
        if not replicas:
            raise ValueError("a fleet needs at least one replica")
        self.replicas = list(replicas)
        self._samples: deque[RequestSample] = deque(maxlen=max_samples)
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
        with self._lock:
            return [s for s in self._samples if s.head_version == version and s.finished_at >= since]

    # ---- the serving side -------------------------------------------------------------------------
    @property
    def canary(self) -> Canary | None:
        with self._lock:
            return self._canary

    def route(self, request_id: str) -> str:
        """The version a new request decodes with: the canary's for its fraction of request ids, else the
        version the first replica serves."""
        canary = self.canary
        if canary is not None and _unit_hash(request_id) < canary.fraction:
            return canary.version
        return self.serving_versions()[0]

    def record(self, sample: RequestSample) -> None:
        """A finished request (the oldest samples fall off past max_samples)."""
        with self._lock:
            self._samples.append(sample)


__all__ = ["Canary", "Fleet", "LocalFleet", "Replica", "SwapOutcome"]
