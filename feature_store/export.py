"""Export a window of stored records for offline training elsewhere.

Owns: the two offline layouts below. Must not touch: the stored data (export only reads, through the
reader's read-only scan, feature_store.reader.StoreScan: no consumer group, nothing acked). Payloads the scan
cannot read are skipped and counted: `corrupt`, and `refused` (an unknown schema MAJOR version).

Parquet (`export_parquet`), one row per record, schema metadata `trace_schema_version` and
`export_layout = "adaptive-eagle.trace-export/1"`:
  id, request_id, tenant, target_fingerprint, head_version, backend, domain,
  created_at timestamp[us, UTC], input_ids list<int32>, loss_mask list<int8> (1 = generated),
  accept_length_mean float32 (bonus included), verify_steps int32, aux_layer_ids list<int32>, and
  hidden = "float32": aux_hidden list<fixed_size_list<float32, n_aux * H>> (one row per token), or
  hidden = "encoded": aux_codec, aux_rows, aux_cols, aux_data (bytes as stored; decode with
  feature_store.codecs: [aux_rows * n_aux, H] rows), or hidden = "none".
JSONL (`export_jsonl`), SpecForge-style `{id, conversations}` with token ids instead of text:
  {"id", "conversations": [{"role": "user"|"assistant", "token_ids": [...]}, ...],
   "input_ids": [...], "loss_mask": [...], "head_version", "domain", "created_at"}
  turns are the runs of loss_mask (0 = user/prompt, 1 = assistant/generated).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from adaptive_eagle.trace import TRACE_SCHEMA_VERSION, TraceRecord
from feature_store.backend import Backend
from feature_store.reader import RecordFilter, StoreScan
from feature_store.schema import decode_aux

EXPORT_LAYOUT = "adaptive-eagle.trace-export/1"
Hidden = Literal["none", "encoded", "float32"]
BATCH_ROWS = 256


@dataclass(frozen=True)
class ExportResult:
    path: str
    records: int
    tokens: int
    corrupt: int  # payloads skipped as unreadable or lost
    refused: int  # payloads skipped for an unknown schema MAJOR version (upgrade to export them)


def _export_row(eid: str, row: dict, rec: TraceRecord, hidden: Hidden) -> dict:
    out = {
        "id": eid, "request_id": rec.request_id, "tenant": rec.tenant, "target_fingerprint": rec.target_fingerprint,
        "head_version": rec.head_version, "backend": rec.backend, "domain": rec.domain,
        "created_at": int(rec.created_at * 1e6), "input_ids": list(rec.input_ids), "loss_mask": list(rec.loss_mask),
        "accept_length_mean": rec.accept_length_mean, "verify_steps": len(rec.steps),
        "aux_layer_ids": list(rec.aux_layer_ids),
    }
    if hidden == "encoded":
        out.update({k: row.get(k) for k in ("aux_codec", "aux_rows", "aux_cols", "aux_data")})
    elif hidden == "float32":
        out["aux_hidden"] = decode_aux(row)
    return out


def _schema(hidden: Hidden, cols: int | None) -> pa.Schema:
    fields = [("id", pa.string()), ("request_id", pa.string()), ("tenant", pa.string()),
              ("target_fingerprint", pa.string()), ("head_version", pa.string()), ("backend", pa.string()),
              ("domain", pa.string()), ("created_at", pa.timestamp("us", tz="UTC")),
              ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
              ("accept_length_mean", pa.float32()), ("verify_steps", pa.int32()), ("aux_layer_ids", pa.list_(pa.int32()))]
    if hidden == "encoded":
        fields += [("aux_codec", pa.string()), ("aux_rows", pa.int32()), ("aux_cols", pa.int32()),
                   ("aux_data", pa.binary())]
    elif hidden == "float32":
        fields += [("aux_hidden", pa.list_(pa.list_(pa.float32(), cols or 0)))]
    return pa.schema(fields, metadata={"trace_schema_version": TRACE_SCHEMA_VERSION, "export_layout": EXPORT_LAYOUT})


def _hidden_column(arrs: list[np.ndarray | None], typ: pa.DataType) -> pa.Array:
    """list<fixed_size_list<float32, width>> from per-record [tokens, width] arrays (None = null)."""
    width = typ.value_type.list_size
    for a in arrs:
        if a is not None and a.shape[1] != width:
            raise ValueError(f"aux_hidden width {a.shape[1]} differs from the first record's {width}")
    lengths = [0 if a is None else a.shape[0] for a in arrs]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    flat = [a.reshape(-1) for a in arrs if a is not None]
    values = pa.FixedSizeListArray.from_arrays(
        pa.array(np.concatenate(flat) if flat else np.zeros(0, np.float32), pa.float32()), width)
    mask = pa.array([a is None for a in arrs])
    return pa.ListArray.from_arrays(pa.array(offsets), values, mask=mask)


def _to_batch(rows: list[dict], schema: pa.Schema) -> pa.RecordBatch:
    if "aux_hidden" not in schema.names:
        return pa.RecordBatch.from_pylist(rows, schema=schema)
    arrs = [r.pop("aux_hidden") for r in rows]
    batch = pa.RecordBatch.from_pylist(rows, schema=schema.remove(schema.get_field_index("aux_hidden")))
    field = schema.field("aux_hidden")
    return batch.append_column(field, _hidden_column(arrs, field.type)).replace_schema_metadata(schema.metadata)


def export_parquet(backend: Backend, path: str | Path, flt: RecordFilter | None = None,
                   hidden: Hidden = "none") -> ExportResult:
    """Write the records in flt's window to one Parquet file (layout in the module docstring)."""
    path = Path(path)
    scan = StoreScan(backend, flt, hidden=False)  # hidden states are copied or decoded from the row as stored
    writer, rows, n, tokens, schema = None, [], 0, 0, None
    try:
        for s in scan:
            rec = s.record
            r = _export_row(s.id, s.row, rec, hidden)
            if schema is None:
                cols = r["aux_hidden"].shape[1] if hidden == "float32" and r.get("aux_hidden") is not None else None
                schema = _schema(hidden, cols)
                writer = pq.ParquetWriter(path, schema, compression="zstd")
            rows.append(r)
            n, tokens = n + 1, tokens + len(rec.input_ids)
            if len(rows) >= BATCH_ROWS:
                writer.write_batch(_to_batch(rows, schema))
                rows = []
        if writer is None:
            schema = _schema(hidden, None)
            writer = pq.ParquetWriter(path, schema, compression="zstd")
        if rows:
            writer.write_batch(_to_batch(rows, schema))
    finally:
        if writer is not None:
            writer.close()
    return ExportResult(str(path), n, tokens, scan.corrupt, scan.refused)


def conversation_turns(input_ids: tuple[int, ...], loss_mask: tuple[int, ...]) -> list[dict]:
    """Runs of loss_mask as turns: 0 -> user (prompt), 1 -> assistant (generated)."""
    turns: list[dict] = []
    for tok, m in zip(input_ids, loss_mask):
        role = "assistant" if m else "user"
        if not turns or turns[-1]["role"] != role:
            turns.append({"role": role, "token_ids": []})
        turns[-1]["token_ids"].append(int(tok))
    return turns


def export_jsonl(backend: Backend, path: str | Path, flt: RecordFilter | None = None) -> ExportResult:
    """SpecForge-style `{id, conversations}` JSONL with token ids (layout in the module docstring)."""
    path = Path(path)
    scan = StoreScan(backend, flt, hidden=False)
    n = tokens = 0
    with open(path, "w") as f:
        for s in scan:
            rec = s.record
            f.write(json.dumps({
                "id": rec.request_id, "conversations": conversation_turns(rec.input_ids, rec.loss_mask),
                "input_ids": list(rec.input_ids), "loss_mask": list(rec.loss_mask),
                "head_version": rec.head_version, "domain": rec.domain, "created_at": rec.created_at,
            }) + "\n")
            n, tokens = n + 1, tokens + len(rec.input_ids)
    return ExportResult(str(path), n, tokens, scan.corrupt, scan.refused)


def read_parquet_hidden(path: str | Path) -> list[np.ndarray | None]:
    """aux_hidden of a `hidden="float32"` export as [tokens, n_aux * H] float32 arrays (a helper for users)."""
    col = pq.read_table(path, columns=["aux_hidden"]).column("aux_hidden").to_pylist()
    return [None if v is None else np.asarray(v, dtype=np.float32) for v in col]
