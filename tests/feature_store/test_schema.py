"""Versioned Arrow schema: record round trip, version refusal, corrupt payloads."""

import math

import numpy as np
import pyarrow as pa
import pytest

from feature_store.schema import (TRACE_SCHEMA, VERSION_KEY, CorruptRecordError, SchemaVersionError, decode_record,
                                  encode_record, record_to_row)
from tests.feature_store.conftest import make_record


def _with_version(record, version: str) -> bytes:
    schema = TRACE_SCHEMA.with_metadata({VERSION_KEY: version.encode()})
    batch = pa.RecordBatch.from_pylist([record_to_row(record, "bf16")], schema=schema)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()


def test_round_trip_keeps_every_field():
    r = make_record(3, tokens=20, hidden=16, domain=None, head_version=None)
    back = decode_record(encode_record(r, "fp16"))
    assert back.without_hidden().steps[1].rejected_token == -1 and math.isnan(back.steps[1].rejected_draft_prob)
    for f in ("request_id", "target_fingerprint", "head_version", "backend", "input_ids", "loss_mask", "tenant",
              "sampling", "domain", "capture_consent", "aux_layer_ids", "created_at", "schema_version", "compute",
              "lossless"):
        assert getattr(back, f) == getattr(r, f), f
    assert back.steps[0].accept_length == 2 and back.steps[0].rejected_draft_prob == pytest.approx(0.25)
    np.testing.assert_allclose(back.aux_hidden, r.aux_hidden, rtol=2 ** -10, atol=1e-6)


def test_record_without_hidden_states():
    r = make_record(1, hidden=None)
    back = decode_record(encode_record(r, "int8-zstd"))
    assert back.aux_hidden is None and back.input_ids == r.input_ids


def test_unknown_major_version_is_refused_clearly_and_minor_is_accepted():
    r = make_record(0)
    with pytest.raises(SchemaVersionError, match=r"2\.0 is not readable.*supports 1\.x"):
        decode_record(_with_version(r, "2.0"))
    assert decode_record(_with_version(r, "1.7")).schema_version == "1.7"


@pytest.mark.parametrize("payload", [b"", b"garbage" * 10, encode_record(make_record(0), "int8")[:-40]])
def test_corrupt_payloads_raise_corrupt_record_error(payload):
    with pytest.raises(CorruptRecordError):
        decode_record(payload)


def test_version_1_0_payloads_without_compute_columns_still_decode():
    import dataclasses

    r = dataclasses.replace(make_record(2), compute="bfloat16", lossless="lossless up to bf16 rounding")
    assert decode_record(encode_record(r, "bf16")).lossless == "lossless up to bf16 rounding"
    old = pa.schema([f for f in TRACE_SCHEMA if f.name not in ("compute", "lossless")],
                    metadata={VERSION_KEY: b"1.0"})
    row = {k: v for k, v in record_to_row(r, "bf16").items() if k in old.names}
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, old) as w:
        w.write_batch(pa.RecordBatch.from_pylist([row], schema=old))
    back = decode_record(sink.getvalue().to_pybytes())
    assert back.schema_version == "1.0" and back.compute == "" and back.lossless == "" and back.input_ids == r.input_ids


def test_spans_round_trip_are_checked_and_older_payloads_have_none():
    import dataclasses

    r = make_record(4, tokens=20)
    spanned = dataclasses.replace(r, spans=((0, 3, "tools"), (5, 9, "tool_output"), (12, 20, "constrained")))
    assert decode_record(encode_record(spanned, "bf16")).spans == spanned.spans
    for bad in (((3, 3, "user"),), ((0, 21, "user"),), ((4, 8, "user"), (6, 9, "model")), ((0, 2, "shouting"),)):
        with pytest.raises(ValueError, match="invalid span"):
            dataclasses.replace(r, spans=bad)
    old = pa.schema([f for f in TRACE_SCHEMA if f.name != "spans"], metadata={VERSION_KEY: b"1.2"})
    row = {k: v for k, v in record_to_row(spanned, "bf16").items() if k in old.names}
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, old) as w:
        w.write_batch(pa.RecordBatch.from_pylist([row], schema=old))
    back = decode_record(sink.getvalue().to_pybytes())
    assert back.schema_version == "1.2" and back.spans == ()
