"""Replay buffer: a bounded, reservoir-sampled memory of earlier traffic per domain.

Owns: which earlier records the near-line trainer keeps and how many of them go into each batch
(`mix`: a fixed share of rows, drawn across domains so a domain that went quiet is still rehearsed;
a domain whose live acceptance is dropping can be given more weight). Items are encoded trace
records (the store's own compact payloads), so the buffer's memory is the store's bytes, not
float32 features. Must not touch: models, the store itself.

Vocabulary. Every record offered gets a random priority key, uniform in [0, 1). A domain holds
exactly the records it has ever seen whose key is below its threshold; the threshold starts at 1 and
only falls: when a cap binds (`per_domain` records, or `max_bytes` over all domains, the largest
domain giving way first) the held record with the highest key is evicted and its key becomes the
threshold, and a later record whose key is not below it is refused at once. So a domain alone under
its caps holds the longest run of its history, in key order, that fits them: which records are held
depends on keys and sizes, never on when they arrived. Sharing the byte cap, a domain's run is cut
where it had to give way, still by key. Either way every record a domain ever produced had the same
chance to stay, whatever the traffic mix later became and whichever cap binds (priority reservoir
sampling; with equal sizes and only the count cap this is exactly Algorithm R's law). A record
larger than `max_bytes` can never be held and is refused without touching the threshold.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import Generic, Sequence, TypeVar

T = TypeVar("T")

UNTAGGED = ""


@dataclass
class _Reservoir(Generic[T]):
    # a max-heap on the key: (-key, arrival number (a tie-break that never compares items), size, item)
    heap: list[tuple[float, int, int, T]] = field(default_factory=list)
    bytes: int = 0
    seen: int = 0
    threshold: float = 1.0  # keys held are below it; the lowest key ever evicted (1.0: none yet)

    def hold(self, key: float, size: int, item: T, arrival: int) -> None:
        heapq.heappush(self.heap, (-key, arrival, size, item))
        self.bytes += size

    def evict(self) -> None:
        """Drop the held record with the highest key; its key becomes the threshold."""
        neg_key, _, size, _ = heapq.heappop(self.heap)
        self.threshold = -neg_key
        self.bytes -= size


class ReplayBuffer(Generic[T]):
    """Per domain, at most `per_domain` items (and `max_bytes` over all domains, the largest domain
    giving way first), each domain a uniform sample of everything it produced; `sizes` are the items'
    bytes, for the cap."""

    def __init__(self, per_domain: int, max_bytes: int = 1 << 62, seed: int = 0) -> None:
        if per_domain < 1 or max_bytes < 1:
            raise ValueError(f"per_domain ({per_domain}) and max_bytes ({max_bytes}) must be >= 1")
        self.per_domain, self.max_bytes, self._seed = per_domain, max_bytes, seed
        self._rng = random.Random(seed)
        self._res: dict[str, _Reservoir[T]] = {}

    def add(self, item: T, domain: str | None = None, size: int = 0) -> bool:
        """Offer one item; True when it is held after the caps are enforced (it may have displaced an
        earlier item of its domain, or of the largest domain when the byte cap binds)."""
        r = self._res.setdefault(domain or UNTAGGED, _Reservoir())
        r.seen += 1
        key = self._rng.random()
        if key >= r.threshold or size > self.max_bytes:  # an item that can never fit leaves the threshold be
            return False
        r.hold(key, size, item, r.seen)
        self._enforce_caps()
        return key < r.threshold

    def _enforce_caps(self) -> None:
        for r in self._res.values():
            while len(r.heap) > self.per_domain:
                r.evict()
        total = self.bytes
        while total > self.max_bytes:
            largest = max(self._res.values(), key=lambda r: r.bytes)
            before = largest.bytes
            largest.evict()
            total -= before - largest.bytes

    def sample(self, n: int, weights: dict[str, float] | None = None) -> list[tuple[str, T]]:
        """n (domain, item) draws, with replacement: a domain is drawn with probability proportional to
        `weights` (default 1 each, so every domain is rehearsed alike), then an item within it uniformly."""
        domains = [d for d, r in self._res.items() if r.heap]
        if not domains or n <= 0:
            return []
        w = [max(0.0, (weights or {}).get(d, 1.0)) for d in domains]
        if sum(w) <= 0:
            w = [1.0] * len(domains)
        picks = self._rng.choices(domains, weights=w, k=n)
        return [(d, self._rng.choice(self._res[d].heap)[3]) for d in picks]

    def domains(self) -> dict[str, int]:
        return {d: len(r.heap) for d, r in sorted(self._res.items())}

    def seen(self) -> dict[str, int]:
        return {d: r.seen for d, r in sorted(self._res.items())}

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self._res.values())

    def __len__(self) -> int:
        return sum(len(r.heap) for r in self._res.values())

    def _ordered(self) -> list[tuple[str, float, int, T]]:
        """(domain, key, size, item) by domain, then by key (lowest first)."""
        return [(d, -nk, size, item) for d, r in sorted(self._res.items())
                for nk, _, size, item in sorted(r.heap, key=lambda s: (-s[0], s[1]))]

    def items(self) -> list[tuple[str, T]]:
        """Held (domain, item) pairs by domain, then by key; `priorities()["keys"]` follows this order."""
        return [(d, item) for d, _, _, item in self._ordered()]

    def priorities(self) -> dict:
        """What a checkpoint needs besides items and seen counts to go on sampling uniformly: the held
        items' keys (in `items()` order) and each domain's threshold. Plain JSON."""
        return {"keys": [k for _, k, _, _ in self._ordered()],
                "thresholds": {d: r.threshold for d, r in sorted(self._res.items())}}

    def restore(self, items: Sequence[tuple[str, T, int]], seen: dict[str, int],
                priorities: dict | None = None) -> int:
        """Refill from a checkpoint: (domain, item, size) triples, the per-domain seen counts and
        `priorities()`. Without priorities (a checkpoint from before keys) each domain's keys are drawn
        afresh from their law given what was held: holding n of s seen records, the threshold is the
        (n+1)-th lowest of s uniform keys (Beta(n+1, s-n)) and the held keys are uniform below it.
        The caps of this buffer are enforced afterwards (they may be smaller than the saved ones).

        The key stream is then reseeded from the seed and the records seen so far: a restarted process whose
        generator began again at `seed` drew the very keys it already held, and a twin evicted beside one
        held left that one's key at the threshold. A held key equal to its threshold (a checkpoint written
        that way) is dropped, and their number returned; a key above it or outside [0, 1) is refused
        (ValueError, the buffer unchanged)."""
        keys = None if priorities is None else [float(k) for k in priorities["keys"]]
        if keys is not None and len(keys) != len(items):
            raise ValueError(f"replay buffer checkpoint: {len(keys)} keys for {len(items)} items")
        thresholds = {} if priorities is None else {d: float(t) for d, t in priorities["thresholds"].items()}
        if keys is not None and (bad := [k for k in keys if not 0.0 <= k < 1.0]):
            raise ValueError(f"replay buffer checkpoint: key {bad[0]} outside [0, 1)")
        grouped: dict[str, list[tuple[T, int, float | None]]] = {}
        for i, (d, item, size) in enumerate(items):
            grouped.setdefault(d, []).append((item, size, None if keys is None else keys[i]))
        res, dropped = {}, 0
        for d in sorted(set(grouped) | set(seen)):
            held = grouped.get(d, [])
            r = res[d] = _Reservoir(seen=max(seen.get(d, 0), len(held)))
            if keys is None:
                r.threshold = self._rng.betavariate(len(held) + 1, r.seen - len(held)) if r.seen > len(held) else 1.0
                held = [(item, size, r.threshold * self._rng.random()) for item, size, _ in held]
            else:
                r.threshold = min(1.0, float(thresholds.get(d, 1.0)))
                if bad := [k for _, _, k in held if k > r.threshold]:
                    raise ValueError(f"replay buffer checkpoint: key {bad[0]} of domain {d!r} outside "
                                     f"[0, threshold {r.threshold})")
                kept = [h for h in held if h[2] < r.threshold]  # one AT it: the twin of the evicted key
                dropped += len(held) - len(kept)
                held = kept
            for arrival, (item, size, key) in enumerate(held):
                r.hold(key, size, item, arrival)
        self._res = res
        self._rng = random.Random(f"{self._seed}/{sum(r.seen for r in res.values())}")
        self._enforce_caps()
        return dropped


def replay_rows(fresh: int, ratio: float) -> float:
    """Replay rows owed beside `fresh` new rows so they make a `ratio` share of the rows trained (a fraction:
    one long row alone owes a third of a row at ratio 0.25, paid once the fractions add up)."""
    if not 0 <= ratio < 1:
        raise ValueError(f"replay ratio must be in [0, 1), got {ratio}")
    return fresh * ratio / (1 - ratio)


__all__ = ["ReplayBuffer", "UNTAGGED", "replay_rows"]
