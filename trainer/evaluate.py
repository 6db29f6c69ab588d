"""Acceptance replay over a window of stored traffic (`adaptive-eagle eval-head HEAD --root/--config ...`).

Owns: choosing the window of stored records to replay (read with the store's read-only scan,
feature_store.reader.scan_records: no consumer group, no ack, nothing created), loading the heads to compare
(a registry version or a version directory), and replaying them on the same records (trainer.replay). Must
not touch: the store's contents, the registry's champion, the store's backends or payloads (the reader
decodes).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Sequence

from adaptive_eagle.checkpoint import load_head
from adaptive_eagle.registry import HeadRegistry
from adaptive_eagle.targets import Target, load_target
from feature_store.config import StoreConfig
from feature_store.reader import RecordFilter, scan_records
from trainer.replay import ReplayReport, TreeParams, replay_heads

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_window(window: str | None, now: float | None = None) -> float | None:
    """'30m', '6h', '2d' -> the unix time that far back from now; None -> None (everything)."""
    if window is None:
        return None
    m = _DURATION.match(window.strip())
    if not m:
        raise ValueError(f"window {window!r}: use a number and a unit s, m, h or d (e.g. 30m, 6h, 2d)")
    return (now if now is not None else time.time()) - float(m.group(1)) * _UNITS[m.group(2)]


def load_named_head(name: str, target: Target, registry: str | None):
    """A registry version (with `registry`) or a version directory, loaded for `target` in float32."""
    if registry is not None and name in HeadRegistry(registry):
        return HeadRegistry(registry).load(name, target).head.float().eval()
    if not (Path(name) / "head.json").exists():
        raise FileNotFoundError(f"{name}: not a version directory (no head.json)"
                                + ("" if registry else " and no --registry given to look it up as a version"))
    return load_head(name, target).head.float().eval()


def replay_store(heads: Sequence[str], store: StoreConfig, *, registry: str | None = None, window: str | None = None,
                 domains: Sequence[str] | None = None, newest: int | None = 200, tree: TreeParams = TreeParams(),
                 target: Target | str | None = None, progress=None) -> tuple[ReplayReport, dict]:
    """Replay every head on the same stored records. Returns (report, facts about the records)."""
    flt = RecordFilter(since=parse_window(window), domains=frozenset(domains) if domains else None)
    found = scan_records(store, flt, newest)
    records = found.records
    if not isinstance(target, Target):
        target = load_target(target or _target_name(heads[0], registry), purpose="train")
    loaded = {name: load_named_head(name, target, registry) for name in heads}
    report = replay_heads(loaded, records, target, tree, progress)
    facts = {"records": len(records), "unreadable": found.unreadable, "window": window,
             "first": min((r.created_at for r in records), default=None),
             "last": max((r.created_at for r in records), default=None)}
    return report, facts


def _target_name(head: str, registry: str | None) -> str:
    if registry is not None and head in HeadRegistry(registry):
        return HeadRegistry(registry).version(head).target_name
    return load_head(head).meta.target_name


__all__ = ["load_named_head", "parse_window", "replay_store"]
