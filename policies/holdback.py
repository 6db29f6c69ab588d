"""The holdback arm: a fixed share of requests served by the frozen baseline head on the same replicas at the
same time as the adapted one, so that the loop's value is measured as users feel it (time per output token) on
the same load, not estimated from decodes elsewhere.

Owns: ``Holdback`` (the arm's record: the baseline version and its share; which requests it takes, by a hash of
the request id independent of the canary's), ``HoldbackWindow`` (per domain, the newest finished requests of
each arm) and ``LoopGain`` (what one domain's window shows: the frozen arm's median time per output token over
the adapted arm's, with a 90% interval, and the same for accept length). Plain Python. Must not touch: torch,
Ray, serving (which routes the arm's requests and feeds the window), the gates.

Vocabulary: the *holdback* arm decodes with the frozen baseline (the head the loop started from); the *served*
arm is every other request (the champion, or a canary). A gain above 1 means the adapted heads are faster.
"""

from __future__ import annotations

import random
import statistics
import threading
import zlib
from collections import deque
from dataclasses import dataclass

ARMS = ("served", "holdback")
MIN_PER_ARM = 20  # requests each arm needs in a domain before its gain is reported


@dataclass(frozen=True)
class Holdback:
    """`version` (the frozen baseline) decodes `fraction` of new requests."""

    version: str
    fraction: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 0.5:
            raise ValueError(f"holdback fraction must be in [0, 0.5], got {self.fraction}")

    def takes(self, request_id: str) -> bool:
        """Whether the request with this id is held back (stable per id; independent of policies.canary's hash, so
        the canary's share is drawn from the same traffic whether or not a request is held back)."""
        return zlib.crc32(b"holdback/" + request_id.encode()) / 2**32 < self.fraction

    def to_json(self) -> dict:
        return {"version": self.version, "fraction": self.fraction}


@dataclass(frozen=True)
class LoopGain:
    """One domain's adapted-vs-frozen figures over the window. tpot_gain = median time per output token of the
    holdback arm / the served arm's (above 1: adapted is faster); accept_gain likewise for accept length (served
    / holdback). Intervals: 90% bootstrap over requests."""

    domain: str
    served: int
    holdback: int
    tpot_gain: float
    tpot_gain_90: tuple[float, float]
    accept_gain: float
    accept_gain_90: tuple[float, float]


class HoldbackWindow:
    """Per domain and arm, the newest `max_per_arm` finished requests' (time per output token, accept length).
    Thread-safe: the gateway records from its loop while metrics and reports read."""

    def __init__(self, max_per_arm: int = 2000) -> None:
        if max_per_arm < MIN_PER_ARM:
            raise ValueError(f"max_per_arm must be >= {MIN_PER_ARM}, got {max_per_arm}")
        self.max = max_per_arm
        self._rows: dict[tuple[str, str], deque[tuple[float, float]]] = {}
        self._lock = threading.Lock()

    def add(self, domain: str | None, arm: str, tpot_s: float, accept_length: float) -> None:
        """A finished request with more than one output token (its time per output token is defined)."""
        if arm not in ARMS:
            raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")
        with self._lock:
            self._rows.setdefault((domain or "none", arm), deque(maxlen=self.max)).append((tpot_s, accept_length))

    def domains(self) -> list[str]:
        with self._lock:
            return sorted({d for d, _ in self._rows})

    def counts(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return {k: len(v) for k, v in self._rows.items()}

    def gain(self, domain: str, resamples: int = 400, seed: int = 0) -> LoopGain | None:
        """The domain's gain, or None until both arms have MIN_PER_ARM requests in it."""
        with self._lock:
            served = list(self._rows.get((domain, "served"), ()))
            held = list(self._rows.get((domain, "holdback"), ()))
        if len(served) < MIN_PER_ARM or len(held) < MIN_PER_ARM:
            return None
        rng = random.Random(seed)

        def ratios(pick) -> tuple[float, tuple[float, float]]:
            point = pick(served, held)
            boots = sorted(pick(rng.choices(served, k=len(served)), rng.choices(held, k=len(held)))
                           for _ in range(resamples))
            return point, (boots[int(0.05 * resamples)], boots[int(0.95 * resamples) - 1])

        def tpot(s, h) -> float:
            return statistics.median(t for t, _ in h) / max(1e-9, statistics.median(t for t, _ in s))

        def accept(s, h) -> float:
            return statistics.median(a for _, a in s) / max(1e-9, statistics.median(a for _, a in h))

        (t, t90), (a, a90) = ratios(tpot), ratios(accept)
        return LoopGain(domain, len(served), len(held), t, t90, a, a90)


__all__ = ["ARMS", "Holdback", "HoldbackWindow", "LoopGain", "MIN_PER_ARM"]
