"""Reader side: at-least-once delivery of decoded TraceRecords to the trainer, with explicit ack.

Owns: decoding, filtering (time window, head version, domain) and corrupt-payload accounting.
A delivered record stays pending until acked; if its consumer dies, the backend re-delivers it
(Redis: XAUTOCLAIM after claim_idle_ms; local: re-delivery after claim_idle_ms or a restart).
Records outside the filter, and corrupt payloads, are acknowledged and skipped (the filter belongs to
the consumer group). A payload of an unknown schema MAJOR version raises SchemaVersionError and stays
pending: upgrade the reader rather than silently lose data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from adaptive_eagle.trace import TraceRecord
from adaptive_eagle.versions import version_label
from feature_store.backend import Backend, BackendStats, open_backend
from feature_store.config import StoreConfig
from feature_store.schema import CorruptRecordError, decode_record


@dataclass(frozen=True)
class RecordFilter:
    since: float | None = None  # unix seconds, inclusive
    until: float | None = None  # unix seconds, exclusive
    head_versions: frozenset[str] | None = None  # None: any; PLAIN ("none") for plain decoding (head_version None)
    domains: frozenset[str] | None = None  # None: any; use "" for untagged records

    def matches(self, r: TraceRecord) -> bool:
        if self.since is not None and r.created_at < self.since:
            return False
        if self.until is not None and r.created_at >= self.until:
            return False
        if self.head_versions is not None and version_label(r.head_version) not in self.head_versions:
            return False
        return self.domains is None or (r.domain or "") in self.domains


@dataclass(frozen=True)
class Delivery:
    id: str
    record: TraceRecord


@dataclass(frozen=True)
class StoreStats:
    backend: str
    records: int  # stored now
    bytes: int  # stored now
    lag: int  # not yet acknowledged by this reader's group
    pending: int  # delivered to the group, not acknowledged
    dropped: int  # writer side: queue full / store down
    corrupt: int  # unreadable payloads skipped
    opted_out: int  # requests that opted out of capture (never stored)
    written: int
    filtered: int = 0  # this reader: records skipped by its filter
    extra: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, s: BackendStats, filtered: int = 0) -> "StoreStats":
        c = dict(s.counters)
        known = {k: c.pop(k, 0) for k in ("dropped", "corrupt", "opted_out", "written")}
        return cls(s.backend, s.records, s.bytes, s.lag, s.pending, filtered=filtered, extra=c, **known)


class StoreReader:
    def __init__(self, config: StoreConfig, group: str = "trainer", consumer: str = "c0",
                 filter: RecordFilter | None = None, backend: Backend | None = None):
        self.cfg = config
        self.group, self.consumer = group, consumer
        self.filter = filter or RecordFilter()
        self._own_backend = backend is None
        self.backend = backend if backend is not None else open_backend(config)
        self.filtered = 0
        self.corrupt = 0  # seen by this reader (also added to the store's shared counter)

    def read(self, max_records: int = 64, block_ms: int = 0) -> list[Delivery]:
        """Up to max_records decoded records that pass the filter; each must be acked after use."""
        entries = self.backend.read(self.group, self.consumer, max_records, block_ms)
        out, skip, corrupt = [], [], 0
        for e in entries:
            try:
                if e.payload is None:
                    raise CorruptRecordError("payload lost")
                rec = decode_record(e.payload)
            except CorruptRecordError:
                corrupt += 1
                skip.append(e.id)
                continue
            if self.filter.matches(rec):
                out.append(Delivery(e.id, rec))
            else:
                self.filtered += 1
                skip.append(e.id)
        if skip:
            self.backend.ack(self.group, skip)
        if corrupt:
            self.corrupt += corrupt
            self.backend.add_counters({"corrupt": corrupt})
        return out

    def ack(self, deliveries: list[Delivery] | list[str]) -> None:
        ids = [d if isinstance(d, str) else d.id for d in deliveries]
        self.backend.ack(self.group, ids)

    def stats(self) -> StoreStats:
        return StoreStats.of(self.backend.stats(self.group), self.filtered)

    def close(self) -> None:
        if self._own_backend:
            self.backend.close()
