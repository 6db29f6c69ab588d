"""Reader side: filters by time window, head version and domain; filtered records are acked."""

from adaptive_eagle.versions import PLAIN
from feature_store.reader import RecordFilter, StoreReader
from feature_store.writer import StoreWriter
from tests.feature_store.conftest import make_record


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
