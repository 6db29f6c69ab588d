"""Drift signal: an EWMA of live accept length per domain tag, and which domains need training most.

Owns: following the accept length that served requests report (each captured record carries its
own), per domain, against two references: the domain's own level when the current champion
started serving it, and the level over all traffic. A domain whose EWMA stays below either by a
relative margin for `sustain` consecutive records is flagged (a `DriftEvent`, which the trainer
logs) and gets more weight in training batches until it recovers. Must not touch: models, I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

UNTAGGED = ""


@dataclass(frozen=True)
class DriftEvent:
    domain: str
    kind: str  # "drop" (flagged) | "recovered"
    ewma: float
    reference: float  # the level it is compared with
    records: int  # records of this domain seen under the current champion

    def describe(self) -> str:
        what = "dropped to" if self.kind == "drop" else "recovered to"
        return (f"drift: domain {self.domain or 'untagged'} live accept length {what} {self.ewma:.3f} "
                f"(reference {self.reference:.3f}, {self.records} records)")


@dataclass
class _Domain:
    ewma: float = 0.0
    count: int = 0
    baseline: float | None = None  # the domain's own level once min_records were seen
    below: int = 0
    flagged: bool = False


@dataclass
class DriftMonitor:
    alpha: float = 0.05  # EWMA weight of a new record
    drop: float = 0.05  # relative margin below the reference that counts as a drop
    min_records: int = 20  # records of a domain before its level counts
    sustain: int = 10  # consecutive records below the reference before a domain is flagged
    boost: float = 2.0  # batch weight of a flagged domain (others 1.0)
    head_version: str | None = None
    _domains: dict[str, _Domain] = field(default_factory=dict)
    _overall: _Domain = field(default_factory=_Domain)

    def __post_init__(self) -> None:
        if not 0 < self.alpha <= 1 or not 0 < self.drop < 1 or self.min_records < 1 or self.sustain < 1:
            raise ValueError("drift monitor: alpha in (0, 1], drop in (0, 1), min_records and sustain >= 1")

    def _update(self, d: _Domain, x: float) -> None:
        d.count += 1
        d.ewma = x if d.count == 1 else (1 - self.alpha) * d.ewma + self.alpha * x
        if d.baseline is None and d.count >= self.min_records:
            d.baseline = d.ewma

    def observe(self, domain: str | None, accept_length: float, head_version: str | None) -> DriftEvent | None:
        """One served record. A change of head version starts new references (a new champion)."""
        if head_version != self.head_version:
            self.reset(head_version)
        key = domain or UNTAGGED
        d = self._domains.setdefault(key, _Domain())
        self._update(d, accept_length)
        self._update(self._overall, accept_length)
        if d.count < self.min_records:
            return None
        reference = self._reference(d)
        reference = d.ewma if reference is None else reference
        low = d.ewma < reference * (1 - self.drop)
        d.below = d.below + 1 if low else 0
        if not d.flagged and d.below >= self.sustain:
            d.flagged = True
            return DriftEvent(key, "drop", d.ewma, reference, d.count)
        if d.flagged and d.ewma >= reference * (1 - self.drop / 2):
            d.flagged = False
            return DriftEvent(key, "recovered", d.ewma, reference, d.count)
        return None

    def reset(self, head_version: str | None) -> None:
        self.head_version = head_version
        self._domains, self._overall = {}, _Domain()

    def weights(self) -> dict[str, float]:
        """Batch weight per domain: `boost` for flagged domains, 1.0 otherwise."""
        return {k: (self.boost if d.flagged else 1.0) for k, d in self._domains.items()}

    def _reference(self, d: _Domain) -> float | None:
        """What a domain's level is compared with: the higher of its own baseline and the overall one."""
        refs = [r for r in (d.baseline, self._overall.baseline) if r is not None]
        return max(refs) if refs else None

    def table(self) -> dict[str, dict]:
        """Per domain: its EWMA, records, flagged, its own baseline and the reference it is compared with."""
        def r4(x: float | None) -> float | None:
            return None if x is None else round(x, 4)

        return {k or "untagged": {"ewma": round(d.ewma, 4), "records": d.count, "flagged": d.flagged,
                                  "baseline": r4(d.baseline), "reference": r4(self._reference(d))}
                for k, d in sorted(self._domains.items())}


__all__ = ["DriftEvent", "DriftMonitor"]
