"""The TraceRecord as a versioned Arrow schema, and one record <-> one Arrow IPC payload.

Owns: column layout, schema version checks, payload (de)serialisation. Must not touch: models, I/O.

Layout (one row per record): metadata columns (ids, fingerprint, head version, backend, tenant,
domain, sampling struct, created_at, compute mode and lossless label since 1.1, the token spans' kinds since
1.3), token columns (`input_ids` int32, `loss_mask` int8, `steps`
list of structs) and optional encoded features: `aux_data` holds the hidden states [T, n_aux * H]
encoded by `aux_codec` as [T * n_aux, H] rows (e.g. int8b: one fp16 scale per 64-channel block of each row), with
`aux_rows` = T and `aux_cols` = n_aux * H; since 1.2 `final_data` holds the final-norm hidden states [T, H]
(`final_rows`, `final_cols`) in the same codec. The schema's metadata carries `trace_schema_version`
(major.minor): a reader accepts any minor of its major and refuses another major, loudly.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from adaptive_eagle.trace import TRACE_SCHEMA_VERSION, SamplingParams, TraceRecord, VerifyStep
from feature_store.codecs import get_codec

VERSION_KEY = b"trace_schema_version"
SUPPORTED_MAJOR = int(TRACE_SCHEMA_VERSION.split(".")[0])


class SchemaVersionError(ValueError):
    """A payload written by an incompatible (unknown major) schema version."""


class CorruptRecordError(ValueError):
    """A payload that is not a readable trace record."""


SAMPLING_TYPE = pa.struct([("temperature", pa.float32()), ("top_p", pa.float32()), ("top_k", pa.int32()),
                           ("max_tokens", pa.int32()), ("seed", pa.int64())])
STEP_TYPE = pa.struct([("tree_size", pa.int32()), ("accept_length", pa.int32()), ("accepted_depth", pa.int32()),
                       ("rejected_token", pa.int32()), ("rejected_draft_prob", pa.float32()),
                       ("rejected_target_prob", pa.float32())])

SPAN_TYPE = pa.struct([("start", pa.int32()), ("end", pa.int32()), ("kind", pa.string())])

TRACE_SCHEMA = pa.schema(
    [
        ("request_id", pa.string()), ("tenant", pa.string()), ("target_fingerprint", pa.string()),
        ("head_version", pa.string()), ("backend", pa.string()), ("domain", pa.string()),
        ("capture_consent", pa.bool_()), ("created_at", pa.float64()), ("sampling", SAMPLING_TYPE),
        ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())), ("steps", pa.list_(STEP_TYPE)),
        ("aux_layer_ids", pa.list_(pa.int32())), ("aux_codec", pa.string()), ("aux_rows", pa.int32()),
        ("aux_cols", pa.int32()), ("aux_data", pa.binary()),
        ("compute", pa.string()), ("lossless", pa.string()),  # since 1.1
        ("final_rows", pa.int32()), ("final_cols", pa.int32()), ("final_data", pa.binary()),  # since 1.2
        ("spans", pa.list_(SPAN_TYPE)),  # since 1.3
    ],
    metadata={VERSION_KEY: TRACE_SCHEMA_VERSION.encode()},
)


def check_version(version: str) -> None:
    try:
        major = int(version.split(".")[0])
    except ValueError:
        raise SchemaVersionError(f"unparseable trace schema version {version!r}") from None
    if major != SUPPORTED_MAJOR:
        raise SchemaVersionError(
            f"trace schema version {version} is not readable by this reader (supports {SUPPORTED_MAJOR}.x); "
            "upgrade adaptive-eagle on the reader side")


def _encode_aux(record: TraceRecord, codec: str) -> tuple[str | None, int | None, int | None, bytes | None]:
    x = record.aux_hidden  # [T, n_aux * H] float32
    if x is None:
        return None, None, None, None
    rows, cols = x.shape
    n_aux = len(record.aux_layer_ids)
    split = n_aux if n_aux and cols % n_aux == 0 else 1
    data = get_codec(codec).encode(np.ascontiguousarray(x, dtype=np.float32).reshape(rows * split, cols // split))
    return codec, rows, cols, data


def _encode_final(record: TraceRecord, codec: str) -> tuple[int | None, int | None, bytes | None]:
    x = record.final_hidden  # [T, H] float32
    if x is None:
        return None, None, None
    rows, cols = x.shape
    return rows, cols, get_codec(codec).encode(np.ascontiguousarray(x, dtype=np.float32))


def record_to_row(record: TraceRecord, codec: str) -> dict:
    aux_codec, aux_rows, aux_cols, aux_data = _encode_aux(record, codec)
    final_rows, final_cols, final_data = _encode_final(record, codec)
    if final_data is not None:
        aux_codec = codec
    s = record.sampling
    return {
        "request_id": record.request_id, "tenant": record.tenant, "target_fingerprint": record.target_fingerprint,
        "head_version": record.head_version, "backend": record.backend, "domain": record.domain,
        "capture_consent": record.capture_consent, "created_at": float(record.created_at),
        "sampling": {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                     "max_tokens": s.max_tokens, "seed": s.seed},
        "input_ids": list(record.input_ids), "loss_mask": list(record.loss_mask),
        "steps": [{"tree_size": st.tree_size, "accept_length": st.accept_length,
                   "accepted_depth": st.accepted_depth, "rejected_token": st.rejected_token,
                   "rejected_draft_prob": st.rejected_draft_prob, "rejected_target_prob": st.rejected_target_prob}
                  for st in record.steps],
        "aux_layer_ids": list(record.aux_layer_ids), "aux_codec": aux_codec, "aux_rows": aux_rows,
        "aux_cols": aux_cols, "aux_data": aux_data, "compute": record.compute, "lossless": record.lossless,
        "final_rows": final_rows, "final_cols": final_cols, "final_data": final_data,
        "spans": [{"start": a, "end": b, "kind": k} for a, b, k in record.spans],
    }


def encode_record(record: TraceRecord, codec: str) -> bytes:
    """One record -> Arrow IPC stream bytes (schema + one row)."""
    batch = pa.RecordBatch.from_pylist([record_to_row(record, codec)], schema=TRACE_SCHEMA)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, TRACE_SCHEMA) as w:
        w.write_batch(batch)
    return sink.getvalue().to_pybytes()


def decode_aux(row: dict) -> np.ndarray | None:
    """[aux_rows, aux_cols] float32 from an encoded row, or None."""
    if row.get("aux_data") is None:
        return None
    rows, cols = int(row["aux_rows"]), int(row["aux_cols"])
    n_aux = len(row["aux_layer_ids"] or ())
    split = n_aux if n_aux and cols % n_aux == 0 else 1
    return get_codec(row["aux_codec"]).decode(row["aux_data"], rows * split, cols // split).reshape(rows, cols)


def decode_final(row: dict) -> np.ndarray | None:
    """[final_rows, final_cols] float32 from an encoded row (schema >= 1.2), or None."""
    if row.get("final_data") is None:
        return None
    rows, cols = int(row["final_rows"]), int(row["final_cols"])
    return get_codec(row["aux_codec"]).decode(row["final_data"], rows, cols).reshape(rows, cols)


def _nan(v: float | None) -> float:
    return math.nan if v is None else float(v)


def row_to_record(row: dict, version: str = TRACE_SCHEMA_VERSION) -> TraceRecord:
    s = row["sampling"] or {}
    steps = tuple(VerifyStep(st["tree_size"], st["accept_length"], st["accepted_depth"], st["rejected_token"],
                             _nan(st["rejected_draft_prob"]), _nan(st["rejected_target_prob"]))
                  for st in row["steps"] or ())
    return TraceRecord(
        request_id=row["request_id"], target_fingerprint=row["target_fingerprint"],
        head_version=row["head_version"], backend=row["backend"], input_ids=tuple(row["input_ids"]),
        loss_mask=tuple(row["loss_mask"]), steps=steps, tenant=row["tenant"],
        sampling=SamplingParams(temperature=float(s.get("temperature", 0.0)), top_p=float(s.get("top_p", 1.0)),
                                top_k=int(s.get("top_k", 0)), max_tokens=int(s.get("max_tokens", 256)),
                                seed=s.get("seed")),
        domain=row["domain"], capture_consent=bool(row["capture_consent"]), aux_hidden=decode_aux(row),
        aux_layer_ids=tuple(row["aux_layer_ids"] or ()), final_hidden=decode_final(row), created_at=float(row["created_at"]), schema_version=version,
        compute=row.get("compute") or "", lossless=row.get("lossless") or "",
        spans=tuple((int(x["start"]), int(x["end"]), str(x["kind"])) for x in row.get("spans") or ()),
    )


def decode_table(payload: bytes) -> tuple[pa.Table, str]:
    """Payload -> (table, schema version). Raises SchemaVersionError or CorruptRecordError."""
    try:
        table = pa.ipc.open_stream(pa.py_buffer(payload)).read_all()
    except (pa.ArrowInvalid, pa.ArrowException, OSError, ValueError) as e:
        raise CorruptRecordError(f"not an Arrow IPC stream: {e}") from None
    meta = table.schema.metadata or {}
    if VERSION_KEY not in meta:
        raise CorruptRecordError("payload has no trace_schema_version")
    version = meta[VERSION_KEY].decode(errors="replace")
    check_version(version)
    return table, version


def decode_record(payload: bytes) -> TraceRecord:
    """Arrow IPC bytes -> TraceRecord. Refuses an unknown major version (SchemaVersionError); anything
    unreadable raises CorruptRecordError."""
    table, version = decode_table(payload)
    if table.num_rows != 1:
        raise CorruptRecordError(f"expected one row, got {table.num_rows}")
    try:
        return row_to_record(table.slice(0, 1).to_pylist()[0], version)
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptRecordError(f"unreadable trace record: {e}") from None
