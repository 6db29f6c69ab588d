"""Reader side: filters by time window, head version and domain; filtered records are acked. The read-only
scan: a window, the newest records, what it skips counted, no cursor moved, no store created."""

import pytest

from adaptive_eagle.versions import PLAIN
from feature_store.backend import StoreUnavailable
from feature_store.config import StoreConfig
from feature_store.local import LocalBackend
from feature_store.reader import RecordFilter, StoreReader, StoreScan, scan_records
from feature_store.writer import StoreWriter
from tests.feature_store.conftest import make_record
from tests.feature_store.test_schema import _with_version


def test_filters_by_time_window_head_version_and_domain(local_cfg):
    cfg = local_cfg()
    w = StoreWriter(cfg)
    for i in range(10):  # created_at = T0 + i; odd = code, even = english
        w.put(make_record(i, head_version="v2" if i >= 5 else "v1"))
    w.put(make_record(99, head_version=None, domain=None))
    w.close()
    t0 = 1_700_000_000.0

    def read(group, f):
        r = StoreReader(cfg, group=group, filter=f)
        got = [d.record.request_id for d in r.read(100)]
        return got, r

    got, r = read("window", RecordFilter(since=t0 + 2, until=t0 + 6))
    assert got == ["req-2", "req-3", "req-4", "req-5"]
    assert r.filtered == 7 and r.stats().lag == 4  # filtered ones are acked
    got, _ = read("head", RecordFilter(head_versions=frozenset({"v2"})))
    assert got == ["req-5", "req-6", "req-7", "req-8", "req-9"]
    got, _ = read("code", RecordFilter(domains=frozenset({"code"}), head_versions=frozenset({"v1"})))
    assert got == ["req-1", "req-3"]
    got, _ = read("plain", RecordFilter(head_versions=frozenset({PLAIN}), domains=frozenset({""})))
    assert got == ["req-99"]


# ---- the read-only scan ----------------------------------------------------------------------------------
def _filled(local_cfg):
    """Ten records (created_at T0 + i; odd = code), one corrupt payload and one of schema MAJOR 2."""
    cfg = local_cfg()
    w = StoreWriter(cfg)
    for i in range(10):
        w.put(make_record(i))
    w.close()
    b = LocalBackend(cfg)
    b.append([b"corrupt", _with_version(make_record(20), "2.0")])
    b.close()
    return cfg


def test_scan_records_reads_a_window_counts_what_it_skips_and_moves_no_cursor(local_cfg):
    cfg = _filled(local_cfg)
    t0 = 1_700_000_000.0
    found = scan_records(cfg, RecordFilter(since=t0 + 2, until=t0 + 8, domains=frozenset({"code"})))
    assert [r.request_id for r in found.records] == ["req-3", "req-5", "req-7"]
    assert (found.corrupt, found.refused, found.unreadable) == (1, 1, 2)
    assert found.records[0].aux_hidden is not None  # hidden states decoded
    newest = scan_records(cfg, None, newest=3)
    assert [r.request_id for r in newest.records] == ["req-7", "req-8", "req-9"]  # oldest first
    assert StoreReader(cfg).stats().lag == 12  # no group read, nothing acked


def test_scan_records_never_creates_a_store_and_leaves_a_given_backend_open(local_cfg, tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(StoreUnavailable, match="no feature store here"):
        scan_records(StoreConfig(backend="local", local_root=str(missing)), RecordFilter())
    assert not missing.exists()
    cfg = _filled(local_cfg)

    class Given:  # the caller's backend: scanned, never closed by the scan
        def __init__(self, inner):
            self.inner, self.closed = inner, 0

        def scan(self, since=None, until=None):
            return self.inner.scan(since, until)

        def close(self):
            self.closed += 1

    b = Given(LocalBackend(cfg, create=False))
    assert len(scan_records(b, RecordFilter(domains=frozenset({"english"}))).records) == 5 and b.closed == 0
    scan = StoreScan(b, RecordFilter(domains=frozenset({"english"})), hidden=False)
    got = list(scan)
    assert len(got) == 5 and got[0].record.aux_hidden is None and got[0].row["aux_data"] is not None
    assert (scan.corrupt, scan.refused, scan.filtered) == (1, 1, 5) and b.closed == 0
    b.inner.close()
