"""Rendering of the promotion log for on-call: a rich table read in a minute, or JSON lines.

Owns: how a PromotionEvent looks on a terminal. Must not touch: the log file (``policies.log`` reads it),
decisions, the registry.

Columns: time (UTC), event, by (policy / on-call), versions (champion -> candidate; for a rollback, the
rolled-back version -> the one restored), tail (the compared
quantile, champion -> candidate, with the interval of the gain), mean, n (champion / candidate requests),
reason. Cold-start rows show P95 TPOT in milliseconds (lower is better); the others accept length.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from rich.table import Table

from policies.log import PromotionEvent

STYLES = {"promoted": "bold green", "rejected": "red", "rolled_back": "bold red", "canary_started": "cyan",
          "canary_ended": "cyan", "pinned": "yellow", "unpinned": "yellow", "considered": "", "watch_ended": "green"}


def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _pair(ev: dict, key: str, scale: float, digits: int) -> str:
    a, b = _num(ev.get(f"{key}_champion")), _num(ev.get(f"{key}_candidate"))
    if a is None or b is None:
        return ""
    return f"{a * scale:.{digits}f}→{b * scale:.{digits}f}"


def tail_cell(ev: dict) -> str:
    """'p5 1.412→1.465 [+0.021,+0.088]' (accept length) or 'P95 TPOT 41.2→33.0ms [+2.1,+9.7]' (cold start);
    'low25 ...' when the tail is the mean of the lowest 25% (tail_statistic: tail_mean)."""
    tpot = ev.get("metric") == "tpot_s"
    scale, digits, unit = (1000.0, 1, "ms") if tpot else (1.0, 3, "")
    pair = _pair(ev, "tail", scale, digits)
    if not pair:
        return ""
    q = _num(ev.get("quantile"))
    pct = round(100 * q) if q is not None else "?"
    label = f"P{pct} TPOT " if tpot else f"p{pct} "
    if ev.get("statistic") == "tail_mean":  # the mean beyond the quantile: "low25 ...", "top5 TPOT ..."
        label = f"top{round(100 - 100 * q) if q is not None else '?'} TPOT " if tpot else f"low{pct} "
    lo, hi = _num(ev.get("ci_low")), _num(ev.get("ci_high"))
    ci = f" [{lo * scale:+.{digits}f},{hi * scale:+.{digits}f}]" if lo is not None and hi is not None else ""
    return f"{label}{pair}{unit}{ci}"


def mean_cell(ev: dict) -> str:
    if ev.get("metric") == "tpot_s":
        pair = _pair(ev, "mean", 1000.0, 1)
        return f"{pair}ms" if pair else ""
    pair = _pair(ev, "mean", 1.0, 3)
    if not pair and _num(ev.get("mean_accept_length")) is not None:
        return f"{ev['mean_accept_length']:.3f}"
    return pair


def n_cell(ev: dict) -> str:
    a, b = ev.get("n_champion"), ev.get("n_candidate")
    if a is not None and b is not None:
        return f"{a}/{b}"
    return str(ev["n_live"]) if "n_live" in ev else ""


def versions_cell(e: PromotionEvent) -> str:
    if e.event in ("pinned", "unpinned"):
        return e.candidate or ""
    if e.event == "rolled_back" and e.champion and e.candidate:  # from the bad version back to the previous one
        return f"{e.candidate}→{e.champion}"
    if e.champion and e.candidate and e.champion != e.candidate:
        return f"{e.champion}→{e.candidate}"
    return e.candidate or e.champion or ""


def event_table(events: Iterable[PromotionEvent], *, title: str | None = None) -> Table:
    """The table on-call reads: one row per event, oldest first."""
    table = Table(title=title, show_lines=False, header_style="bold", expand=False)
    for name, kw in (("time (UTC)", {"no_wrap": True}), ("event", {"no_wrap": True}), ("by", {}),
                     ("versions", {}), ("tail", {}), ("mean", {}), ("n", {"justify": "right"}),
                     ("reason", {"ratio": 1})):
        table.add_column(name, **kw)
    for e in events:
        ev = e.evidence or {}
        table.add_row(e.time.replace("T", " ")[:19], e.event, e.by, versions_cell(e), tail_cell(ev), mean_cell(ev),
                      n_cell(ev), e.reason, style=STYLES.get(e.event, ""))
    return table


def json_lines(events: Iterable[PromotionEvent]) -> Iterator[str]:
    """One JSON object per event, as stored."""
    for e in events:
        yield e.line()


__all__ = ["event_table", "json_lines", "mean_cell", "n_cell", "tail_cell", "versions_cell"]
