"""Export round trip: Parquet (with float32 / encoded / no hidden states) and SpecForge-style JSONL."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from feature_store.export import export_jsonl, export_parquet, read_parquet_hidden
from feature_store.local import LocalBackend
from feature_store.reader import RecordFilter
from feature_store.schema import decode_aux
from feature_store.writer import StoreWriter
from tests.feature_store.conftest import make_record


@pytest.fixture
def filled(local_cfg):
    cfg = local_cfg(codec="fp16")
    w = StoreWriter(cfg)
    recs = [make_record(i, tokens=10 + i) for i in range(6)] + [make_record(6, hidden=None)]
    for r in recs:
        w.put(r)
    w.close()
    b = LocalBackend(cfg)
    b.append([b"corrupt"])
    return b, recs


def test_parquet_round_trip_with_float32_hidden_states(filled, tmp_path):
    b, recs = filled
    res = export_parquet(b, tmp_path / "x.parquet", hidden="float32")
    assert (res.records, res.corrupt) == (7, 1) and res.tokens == sum(len(r.input_ids) for r in recs)
    t = pq.read_table(tmp_path / "x.parquet")
    assert t.schema.metadata[b"export_layout"] == b"adaptive-eagle.trace-export/1"
    assert t.column("request_id").to_pylist() == [r.request_id for r in recs]
    assert t.column("input_ids").to_pylist() == [list(r.input_ids) for r in recs]
    assert t.column("loss_mask").to_pylist() == [list(r.loss_mask) for r in recs]
    hidden = read_parquet_hidden(tmp_path / "x.parquet")
    for h, r in zip(hidden, recs):
        if r.aux_hidden is None:
            assert h is None
        else:
            np.testing.assert_allclose(h, r.aux_hidden, rtol=2 ** -10, atol=1e-6)


def test_parquet_window_and_encoded_hidden(filled, tmp_path):
    b, recs = filled
    t0 = recs[0].created_at
    res = export_parquet(b, tmp_path / "w.parquet", RecordFilter(since=t0 + 1, until=t0 + 3), hidden="encoded")
    t = pq.read_table(tmp_path / "w.parquet")
    assert res.records == 2 and t.column("request_id").to_pylist() == ["req-1", "req-2"]
    row = t.slice(0, 1).to_pylist()[0]
    np.testing.assert_allclose(decode_aux(row), recs[1].aux_hidden, rtol=2 ** -10, atol=1e-6)
    assert export_parquet(b, tmp_path / "e.parquet", RecordFilter(since=t0 + 100)).records == 0
    assert pq.read_table(tmp_path / "e.parquet").num_rows == 0


def test_jsonl_is_specforge_style_with_token_turns(filled, tmp_path):
    b, recs = filled
    res = export_jsonl(b, tmp_path / "x.jsonl", RecordFilter(domains=frozenset({"code"})))
    lines = [json.loads(line) for line in (tmp_path / "x.jsonl").read_text().splitlines()]
    assert res.records == len(lines) == 3
    for line in lines:
        rec = next(r for r in recs if r.request_id == line["id"])
        assert [t["role"] for t in line["conversations"]] == ["user", "assistant"]
        assert sum((t["token_ids"] for t in line["conversations"]), []) == list(rec.input_ids)
        assert line["loss_mask"] == list(rec.loss_mask)


def test_export_skips_and_counts_payloads_of_an_unknown_schema_major(filled, tmp_path):
    from tests.feature_store.test_schema import _with_version

    b, recs = filled
    b.append([_with_version(recs[0], "2.0")])
    res = export_jsonl(b, tmp_path / "x.jsonl")
    assert (res.records, res.corrupt, res.refused) == (7, 1, 1)
