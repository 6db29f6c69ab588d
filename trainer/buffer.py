"""Replay buffer: a bounded, reservoir-sampled memory of earlier traffic per domain.

Owns: which earlier records the near-line trainer keeps (Algorithm R per domain tag, so every
record a domain ever produced had the same chance to stay, whatever the traffic mix later became)
and how many of them go into each batch (`mix`: a fixed share of rows, drawn across domains so a
domain that went quiet is still rehearsed; a domain whose live acceptance is dropping can be given
more weight). Items are encoded trace records (the store's own compact payloads), so the buffer's
memory is the store's bytes, not float32 features. Must not touch: models, the store itself.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Generic, Sequence, TypeVar

T = TypeVar("T")

UNTAGGED = ""


@dataclass
class _Reservoir(Generic[T]):
    items: list[T] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    seen: int = 0


class ReplayBuffer(Generic[T]):
    """Per domain, at most `per_domain` items (and `max_bytes` over all domains, the largest domain
    giving way first); `sizes` are the items' bytes, for the cap."""

    def __init__(self, per_domain: int, max_bytes: int = 1 << 62, seed: int = 0) -> None:
        if per_domain < 1 or max_bytes < 1:
            raise ValueError(f"per_domain ({per_domain}) and max_bytes ({max_bytes}) must be >= 1")
        self.per_domain, self.max_bytes = per_domain, max_bytes
        self._rng = random.Random(seed)
        self._res: dict[str, _Reservoir[T]] = {}

    def add(self, item: T, domain: str | None = None, size: int = 0) -> bool:
        """Offer one item; True when it was kept (it may replace an earlier one of its domain)."""
        r = self._res.setdefault(domain or UNTAGGED, _Reservoir())
        r.seen += 1
        if len(r.items) < self.per_domain:
            r.items.append(item)
            r.sizes.append(size)
            kept = True
        else:
            j = self._rng.randrange(r.seen)
            kept = j < self.per_domain
            if kept:
                r.items[j], r.sizes[j] = item, size
        self._shrink()
        return kept

    def _shrink(self) -> None:
        while self.bytes > self.max_bytes:
            largest = max(self._res.values(), key=lambda r: sum(r.sizes))
            k = self._rng.randrange(len(largest.items))
            largest.items.pop(k)
            largest.sizes.pop(k)

    def sample(self, n: int, weights: dict[str, float] | None = None) -> list[tuple[str, T]]:
        """n (domain, item) draws, with replacement: a domain is drawn with probability proportional to
        `weights` (default 1 each, so every domain is rehearsed alike), then an item within it uniformly."""
        domains = [d for d, r in self._res.items() if r.items]
        if not domains or n <= 0:
            return []
        w = [max(0.0, (weights or {}).get(d, 1.0)) for d in domains]
        if sum(w) <= 0:
            w = [1.0] * len(domains)
        picks = self._rng.choices(domains, weights=w, k=n)
        return [(d, self._rng.choice(self._res[d].items)) for d in picks]

    def domains(self) -> dict[str, int]:
        return {d: len(r.items) for d, r in sorted(self._res.items())}

    def seen(self) -> dict[str, int]:
        return {d: r.seen for d, r in sorted(self._res.items())}

    @property
    def bytes(self) -> int:
        return sum(sum(r.sizes) for r in self._res.values())

    def __len__(self) -> int:
        return sum(len(r.items) for r in self._res.values())

    def items(self) -> list[tuple[str, T]]:
        return [(d, x) for d, r in sorted(self._res.items()) for x in r.items]

    def restore(self, items: Sequence[tuple[str, T, int]], seen: dict[str, int]) -> None:
        """Refill from a checkpoint: (domain, item, size) triples and the per-domain seen counts."""
        self._res = {}
        for d, item, size in items:
            r = self._res.setdefault(d, _Reservoir())
            r.items.append(item)
            r.sizes.append(size)
        for d, n in seen.items():
            self._res.setdefault(d, _Reservoir()).seen = max(n, len(self._res[d].items))


def replay_rows(fresh: int, ratio: float) -> int:
    """Replay rows to add to `fresh` new rows so they make a `ratio` share of the batch."""
    if not 0 <= ratio < 1:
        raise ValueError(f"replay ratio must be in [0, 1), got {ratio}")
    return round(fresh * ratio / (1 - ratio)) if fresh else 0


__all__ = ["ReplayBuffer", "UNTAGGED", "replay_rows"]
