"""`adaptive-eagle store stats|tail|export`: the feature store's command line (mounted by
adaptive_eagle_cli). Thin: builds a StoreConfig, calls the package, prints rich tables."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import typer

store_app = typer.Typer(help="Inspect and export the feature store (traces and hidden states).",
                        no_args_is_help=True, add_completion=False)

CONFIG = typer.Option(None, "--config", "-c", help="StoreConfig JSON file")
ROOT = typer.Option(None, "--root", help="local backend directory (instead of --config)")
REDIS = typer.Option(None, "--redis-url", help="Redis URL (instead of --config)")
PREFIX = typer.Option("ae", "--prefix", help="Redis key prefix (with --redis-url)")


def _config(config: Optional[Path], root: Optional[Path], redis_url: Optional[str], prefix: str):
    from feature_store.config import StoreConfigError, store_config_from_options

    try:
        cfg = store_config_from_options(config, root, redis_url, prefix)
    except StoreConfigError as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    if cfg is None:
        typer.secho("error: give --config, --root or --redis-url", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    return cfg


def _backend(cfg):
    from feature_store.backend import StoreUnavailable, open_backend

    try:
        b = open_backend(cfg, create=False)  # read-only commands never create a store
        b.ping()
    except StoreUnavailable as e:
        typer.secho(f"error: store unavailable: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
    return b


def _when(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _parse_time(s: Optional[str]) -> Optional[float]:
    if s is None:
        return None
    try:
        return float(s)
    except ValueError:
        dt = datetime.fromisoformat(s)
        return (dt if dt.tzinfo else dt.replace(tzinfo=timezone.utc)).timestamp()


@store_app.command("stats")
def stats(config: Optional[Path] = CONFIG, root: Optional[Path] = ROOT, redis_url: Optional[str] = REDIS,
          prefix: str = PREFIX, group: str = typer.Option("trainer", help="consumer group whose lag to show"),
          as_json: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """Records, bytes, the group's lag and pending, and the dropped / corrupt / opted-out counters."""
    import json
    from dataclasses import asdict

    from rich.console import Console
    from rich.table import Table

    from feature_store.reader import StoreReader

    cfg = _config(config, root, redis_url, prefix)
    s = StoreReader(cfg, group=group, backend=_backend(cfg)).stats()
    if as_json:
        typer.echo(json.dumps(asdict(s)))
        return
    t = Table(title=f"feature store ({s.backend}), group {group!r}")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rows = [("records", s.records), ("bytes", f"{s.bytes:,}"), ("lag", s.lag), ("pending", s.pending),
            ("written", s.written), ("dropped", s.dropped), ("corrupt", s.corrupt), ("opted out", s.opted_out)]
    for k, v in rows + sorted(s.extra.items()):
        t.add_row(k, str(v))
    Console(width=120).print(t)


@store_app.command("tail")
def tail(config: Optional[Path] = CONFIG, root: Optional[Path] = ROOT, redis_url: Optional[str] = REDIS,
         prefix: str = PREFIX, n: int = typer.Option(10, "-n", help="how many of the newest records")) -> None:
    """The newest records, one line each (no consumer group; nothing is acked)."""
    from rich.console import Console
    from rich.table import Table

    from feature_store.schema import CorruptRecordError, SchemaVersionError, decode_table

    cfg = _config(config, root, redis_url, prefix)
    t = Table(title=f"newest {n} records")
    for col in ("id", "created (UTC)", "request", "tenant", "head", "domain", "tokens", "generated", "accept len",
                "hidden"):
        t.add_column(col)
    for e in _backend(cfg).tail(n):
        try:
            table, _ = decode_table(e.payload or b"")
            r = table.slice(0, 1).to_pylist()[0]
        except (CorruptRecordError, SchemaVersionError) as err:
            t.add_row(e.id, "", f"[red]unreadable: {err}", *[""] * 7)
            continue
        steps = r["steps"] or []
        acc = sum(s["accept_length"] + 1 for s in steps) / len(steps) if steps else 1.0
        hid = f"{r['aux_codec']} {len(r['aux_data']):,} B" if r["aux_data"] is not None else "-"
        t.add_row(e.id, _when(r["created_at"]), r["request_id"], r["tenant"], r["head_version"] or "-",
                  r["domain"] or "-", str(len(r["input_ids"])), str(sum(r["loss_mask"])), f"{acc:.2f}", hid)
    Console(width=200).print(t)


@store_app.command("export")
def export(out: Path = typer.Argument(..., help="output file (.parquet or .jsonl)"),
           config: Optional[Path] = CONFIG, root: Optional[Path] = ROOT, redis_url: Optional[str] = REDIS,
           prefix: str = PREFIX,
           fmt: Optional[str] = typer.Option(None, "--format", help="parquet | jsonl (default: from the suffix)"),
           since: Optional[str] = typer.Option(None, help="window start: unix seconds or ISO time (UTC)"),
           until: Optional[str] = typer.Option(None, help="window end (exclusive)"),
           head_version: Optional[str] = typer.Option(None, help="only records of this head version (\"none\": plain decoding)"),
           domain: Optional[str] = typer.Option(None, help="only records with this domain tag"),
           hidden: str = typer.Option("none", help="parquet: none | encoded | float32")) -> None:
    """Export a window of records: Parquet, or SpecForge-style {id, conversations} JSONL with token ids."""
    from feature_store.export import export_jsonl, export_parquet
    from feature_store.reader import RecordFilter

    fmt = fmt or ("jsonl" if out.suffix == ".jsonl" else "parquet")
    if fmt not in ("parquet", "jsonl") or hidden not in ("none", "encoded", "float32"):
        typer.secho("error: --format parquet|jsonl, --hidden none|encoded|float32", fg=typer.colors.RED, err=True)
        raise typer.Exit(2)
    cfg = _config(config, root, redis_url, prefix)
    flt = RecordFilter(since=_parse_time(since), until=_parse_time(until),
                       head_versions=frozenset({head_version}) if head_version else None,
                       domains=frozenset({domain}) if domain else None)
    b = _backend(cfg)
    res = export_jsonl(b, out, flt) if fmt == "jsonl" else export_parquet(b, out, flt, hidden=hidden)  # type: ignore
    typer.echo(f"wrote {res.records} records ({res.tokens} tokens) to {res.path}; skipped {res.corrupt} corrupt"
               + (f", {res.refused} of an unknown schema version" if res.refused else ""))
