"""Reader side: every way out of the store for decoded TraceRecords.

Two ways, one decoding and one filter:
- `StoreReader`, the consumer-group reader: at-least-once delivery to the trainer, with explicit ack. A
  delivered record stays pending until acked; if its consumer dies, the backend re-delivers it (Redis:
  XAUTOCLAIM after claim_idle_ms; local: re-delivery after claim_idle_ms or a restart). Records outside the
  filter, and corrupt payloads, are acknowledged and skipped (the filter belongs to the consumer group). A
  payload of an unknown schema MAJOR version raises SchemaVersionError and stays pending: upgrade the reader
  rather than silently lose data.
- `StoreScan` / `scan_records`, the read-only scan of a window (evaluation, export, benchmarks): no consumer
  group, nothing acked, nothing created (a store that is not there is an error, never made). It skips and
  counts what it cannot read: `corrupt` payloads, and `refused` ones of an unknown schema MAJOR version
  (nothing is lost: the scan moves no cursor).

Owns: decoding, filtering (time window, head version, domain) and corrupt-payload accounting. Must not
touch: the stored data (readers never write records), models.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

from adaptive_eagle.trace import TraceRecord
from adaptive_eagle.versions import version_label
from feature_store.backend import Backend, BackendStats, open_backend
from feature_store.config import StoreConfig
from feature_store.schema import CorruptRecordError, SchemaVersionError, decode_table, row_to_record


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
                _, rec = _decode(e.payload, hidden=True)
            except CorruptRecordError:  # an unknown MAJOR version (SchemaVersionError) is raised: it stays pending
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


# ---- the read-only scan ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scanned:
    id: str  # the backend's entry id
    record: TraceRecord  # with its hidden states decoded, or without them (StoreScan(hidden=False))
    row: dict  # the record's row as stored (hidden states still encoded: what an export of them copies)


def _decode(payload: bytes | None, hidden: bool) -> tuple[dict, TraceRecord]:
    """A stored payload -> (its row as stored, the record), with the checks of `schema.decode_record`: raises
    SchemaVersionError (an unknown MAJOR version) or CorruptRecordError (anything else unreadable, a lost
    payload included). hidden=False leaves the record's hidden states out (not decoded)."""
    if payload is None:
        raise CorruptRecordError("payload lost")
    table, version = decode_table(payload)
    if table.num_rows != 1:
        raise CorruptRecordError(f"expected one row, got {table.num_rows}")
    try:
        row = table.slice(0, 1).to_pylist()[0]
        return row, row_to_record(row if hidden else {**row, "aux_data": None, "final_data": None}, version)
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptRecordError(f"unreadable trace record: {e}") from None


class StoreScan:
    """One read-only pass over the stored records in a filter's window, in write order: iterate it (once) for
    the readable records that pass the filter. It counts what it skips as it goes: `corrupt` (unreadable or
    lost payloads), `refused` (an unknown schema MAJOR version) and `filtered` (outside the filter). No
    consumer group, no ack; the backend is the caller's (open it with create=False, close it after)."""

    def __init__(self, backend: Backend, flt: RecordFilter | None = None, hidden: bool = True) -> None:
        self.backend, self.filter, self.hidden = backend, flt or RecordFilter(), hidden
        self.corrupt = self.refused = self.filtered = 0

    def __iter__(self) -> Iterator[Scanned]:
        for e in self.backend.scan(self.filter.since, self.filter.until):
            try:
                row, rec = _decode(e.payload, self.hidden)
            except SchemaVersionError:
                self.refused += 1
                continue
            except CorruptRecordError:
                self.corrupt += 1
                continue
            if self.filter.matches(rec):
                yield Scanned(e.id, rec, row)
            else:
                self.filtered += 1


@dataclass(frozen=True)
class ScanResult:
    records: list[TraceRecord]  # passing the filter, oldest first (the newest `newest` of them when capped)
    corrupt: int  # payloads skipped as unreadable or lost
    refused: int  # payloads skipped for an unknown schema MAJOR version

    @property
    def unreadable(self) -> int:
        return self.corrupt + self.refused


def scan_records(store: StoreConfig | Backend, flt: RecordFilter | None = None,
                 newest: int | None = None) -> ScanResult:
    """The records (hidden states decoded) in `flt`'s window, oldest first, at most the `newest` ones, with what
    was skipped as unreadable. Read-only: a StoreConfig is opened with create=False (a store that is not there
    raises StoreUnavailable and is not made) and closed again; a Backend given is used and left open."""
    backend = open_backend(store, create=False) if isinstance(store, StoreConfig) else store
    scan = StoreScan(backend, flt)
    try:
        keep: deque[TraceRecord] = deque((s.record for s in scan), maxlen=newest)
    finally:
        if backend is not store:
            backend.close()
    return ScanResult(list(keep), scan.corrupt, scan.refused)


__all__ = ["Delivery", "RecordFilter", "ScanResult", "Scanned", "StoreReader", "StoreScan", "StoreStats",
           "scan_records"]
