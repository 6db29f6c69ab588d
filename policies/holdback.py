"""The holdback arm: a fixed share of requests served by the frozen baseline head on the same replicas at the
same time as the adapted one, so that the loop's value is measured as users feel it (time per output token) on
the same load, not estimated from decodes elsewhere.

Owns: ``Holdback`` (the arm's record: the baseline version and its share; which requests it takes, by a hash of
the request id independent of the canary's), ``HoldbackWindow`` (per domain, the newest finished requests of
each arm, and the domain's blocks of served requests), ``LoopGain`` (what one domain's window shows: the frozen
arm's median time per output token over the adapted arm's, with a 90% interval, and the same for accept length)
and ``Forgetting`` (how far a domain's newest block fell below the best block the run served on it, each block's
accept length taken relative to the frozen arm's). Plain Python. Must not touch: torch,
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
from typing import Sequence

ARMS = ("served", "holdback")
MIN_PER_ARM = 20  # requests each arm needs in a domain before its gain is reported
BLOCK = 50  # served requests of a domain in one forgetting block


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


@dataclass(frozen=True)
class Forgetting:
    """One domain's forgetting: 100 * (1 - newest block's gain / best block's gain), where a block is BLOCK
    consecutive served requests of the domain and its gain is their median accept length over the frozen arm's
    median in the window when the block closed (so the prompts' difficulty cancels as far as the frozen arm sees
    it). Positive: the served heads lost part of the best gain they ever had on the domain. The best of noisy
    blocks is biased upward, so a small positive point is noise: read the 90% interval (bootstrap over both
    blocks' requests)."""

    domain: str
    pct: float
    pct_90: tuple[float, float]
    blocks: int  # blocks closed on the domain (at least 2 before a figure)
    best_gain: float
    newest_gain: float


@dataclass(frozen=True)
class _Block:
    accept: tuple[float, ...]  # the served requests' accept lengths
    frozen: float  # the frozen arm's median accept length on the domain when the block closed

    @property
    def gain(self) -> float:
        return statistics.median(self.accept) / max(1e-9, self.frozen)


class HoldbackWindow:
    """Per domain and arm, the newest `max_per_arm` finished requests' (time per output token, accept length);
    per domain, the best and the newest closed block of `block` served requests (for `forgetting`).
    Thread-safe: the gateway records from its loop while metrics and reports read."""

    def __init__(self, max_per_arm: int = 2000, block: int = BLOCK) -> None:
        if max_per_arm < MIN_PER_ARM:
            raise ValueError(f"max_per_arm must be >= {MIN_PER_ARM}, got {max_per_arm}")
        if block < MIN_PER_ARM:
            raise ValueError(f"block must be >= {MIN_PER_ARM}, got {block}")
        self.max, self.block = max_per_arm, block
        self._rows: dict[tuple[str, str], deque[tuple[float, float]]] = {}
        self._open: dict[str, list[float]] = {}  # domain -> accept lengths of its block being filled
        self._blocks: dict[str, tuple[int, _Block, _Block]] = {}  # domain -> (closed blocks, best, newest)
        self._lock = threading.Lock()

    def add(self, domain: str | None, arm: str, tpot_s: float, accept_length: float) -> None:
        """A finished request with more than one output token (its time per output token is defined)."""
        if arm not in ARMS:
            raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")
        domain = domain or "none"
        with self._lock:
            self._rows.setdefault((domain, arm), deque(maxlen=self.max)).append((tpot_s, accept_length))
            if arm == "served":
                self._grow_block(domain, accept_length)

    def _grow_block(self, domain: str, accept_length: float) -> None:
        """Add to the domain's open block; a full one closes against the frozen arm's median (a block closing
        before the frozen arm has MIN_PER_ARM requests on the domain has no reference and is dropped)."""
        rows = self._open.setdefault(domain, [])
        rows.append(accept_length)
        if len(rows) < self.block:
            return
        self._open[domain] = []
        frozen = self._rows.get((domain, "holdback"), ())
        if len(frozen) < MIN_PER_ARM:
            return
        new = _Block(tuple(rows), statistics.median(a for _, a in frozen))
        n, best, _ = self._blocks.get(domain, (0, new, new))
        self._blocks[domain] = (n + 1, new if new.gain > best.gain else best, new)

    def forgetting(self, domain: str, resamples: int = 400, seed: int = 0) -> Forgetting | None:
        """The domain's forgetting, or None before two blocks closed on it."""
        with self._lock:
            n, best, newest = self._blocks.get(domain, (0, None, None))
        if n < 2:
            return None
        rng = random.Random(seed)

        def pct(b: Sequence[float], w: Sequence[float]) -> float:
            return 100 * (1 - (statistics.median(w) / newest.frozen) / max(1e-9, statistics.median(b) / best.frozen))

        boots = sorted(pct(rng.choices(best.accept, k=len(best.accept)), rng.choices(newest.accept,
                                                                                    k=len(newest.accept)))
                       for _ in range(resamples))
        return Forgetting(domain, pct(best.accept, newest.accept),
                          (boots[int(0.05 * resamples)], boots[int(0.95 * resamples) - 1]), n, best.gain, newest.gain)

    def medians(self, domain: str) -> dict[str, float]:
        """Each arm's median accept length on the domain over its window (arms with no request left out)."""
        with self._lock:
            rows = {arm: [a for _, a in self._rows.get((domain, arm), ())] for arm in ARMS}
        return {arm: statistics.median(r) for arm, r in rows.items() if r}

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


__all__ = ["ARMS", "BLOCK", "Forgetting", "Holdback", "HoldbackWindow", "LoopGain", "MIN_PER_ARM"]
