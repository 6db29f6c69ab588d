"""The demo's live view: a rich Live panel on a terminal, plain periodic lines elsewhere (CI, pipes).

Owns: `LiveStats` (the finished requests so far: requests/s and tokens/s over a recent window, live
accept length per domain, per head version and per context length (each verify step in the bucket of the
position its first draft predicts, as the responses' `adaptive_eagle.by_context` reports it), failures),
polling the trainer's status, tailing the promotion log for gate decisions as they happen, and drawing all
of it. Must not touch: the stack's
parts (it only reads the trainer's status and the log file), the traffic.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from adaptive_eagle.positions import bucket_labels
from adaptive_eagle_cli.demo.traffic import RequestResult

WINDOW_S = 60.0  # requests/s and tokens/s over the last minute
RECENT = 20  # live accept length: the last N requests of a domain


@dataclass
class LiveStats:
    results: list[RequestResult] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, result: RequestResult) -> None:
        with self.lock:
            self.results.append(result)

    def snapshot(self) -> list[RequestResult]:
        with self.lock:
            return list(self.results)

    def rates(self, now_s: float) -> tuple[float, float]:
        """(requests/s, generated tokens/s) over the last WINDOW_S seconds of traffic."""
        recent = [r for r in self.snapshot() if r.ok and r.finished_s >= now_s - WINDOW_S]
        span = max(1.0, min(WINDOW_S, now_s))
        return len(recent) / span, sum(r.completion_tokens for r in recent) / span

    def by(self, key: Callable[[RequestResult], str], last: Optional[int] = None) -> dict[str, tuple[float, int]]:
        """key -> (accept length as tokens per verify step over its last `last` requests, requests)."""
        groups: dict[str, list[RequestResult]] = defaultdict(list)
        for r in self.snapshot():
            if r.ok and r.verify_steps:
                groups[key(r)].append(r)
        out = {}
        for k, rs in sorted(groups.items()):
            tail = rs[-last:] if last else rs
            out[k] = (sum(r.accept_length * r.verify_steps for r in tail) / sum(r.verify_steps for r in tail), len(rs))
        return out

    def by_context(self) -> dict[str, tuple[float, int]]:
        """context bucket -> (accept length as 1 + accepted drafts / verify steps of the steps in it, requests with
        a step in it), in bucket order, over every finished request."""
        steps: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        for r in self.snapshot():
            if r.ok:
                for bucket, n, accepted in r.by_context:
                    t = steps[bucket]
                    t[0], t[1], t[2] = t[0] + n, t[1] + accepted, t[2] + 1
        order = {b: i for i, b in enumerate(bucket_labels())}
        return {b: (1.0 + a / n if n else 1.0, k) for b, (n, a, k) in sorted(steps.items(),
                                                                           key=lambda kv: order.get(kv[0], len(order)))}

    def failures(self) -> int:
        return sum(not r.ok for r in self.snapshot())


class LogTail:
    """New promotion-log events since the last call (the file may not exist yet)."""

    def __init__(self, path: Path) -> None:
        self.path, self.seen = Path(path), 0
        self.events: list = []

    def poll(self) -> list:
        from policies.log import PromotionLog

        if not self.path.is_file():
            return []
        events = PromotionLog(self.path).read().events
        new, self.seen = list(events[self.seen:]), len(events)
        self.events.extend(new)
        return new


def event_line(e) -> str:
    t = e.time[11:19]
    who = f"{e.champion} -> {e.candidate}" if e.candidate else (e.champion or "")
    return f"{t} {e.event:<14} {who}: {e.reason}"


def trainer_line(status: Optional[dict]) -> str:
    if not status:
        return "trainer: starting"
    loss = f"{status['loss']:.3f}" if status.get("loss") is not None else "-"
    return (f"trainer: {status.get('state')} | records {status.get('records_seen', 0)} seen, "
            f"{status.get('records_trained', 0)} trained | {status.get('tokens_trained', 0):,} tokens trained | "
            f"loss {loss} | candidates {status.get('candidates', 0)} (last {status.get('last_candidate') or '-'})"
            + ("" if not status.get("gathering") else " | evidence " + ", ".join(
                f"{g['version']} {g['records']}" for g in status["gathering"])))


class LiveView:
    """Redraws (TTY) or prints (not a TTY) every `every_s` seconds until `stop` is set."""

    def __init__(self, stats: LiveStats, log_path: Path, trainer_status: Callable[[], Optional[dict]],
                 elapsed: Callable[[], float], phase_name: Callable[[float], str], every_s: float,
                 echo: Callable[[str], None] = print, tty: Optional[bool] = None) -> None:
        self.stats, self.tail, self.trainer_status = stats, LogTail(log_path), trainer_status
        self.elapsed, self.phase_name, self.every_s, self.echo = elapsed, phase_name, every_s, echo
        self.tty = sys.stdout.isatty() if tty is None else tty
        self.stop = threading.Event()
        self.status: Optional[dict] = None
        self._thread = threading.Thread(target=self._run, name="demo-view", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self.stop.set()
        self._thread.join(30)

    def _refresh(self) -> list:
        try:
            self.status = self.trainer_status() or self.status
        except Exception:  # noqa: BLE001 - a busy trainer answers next time
            pass
        return self.tail.poll()

    def _run(self) -> None:
        if self.tty:
            self._run_live()
            return
        last = 0.0
        while not self.stop.wait(1.0):
            for e in self._refresh():
                self.echo("gate   " + event_line(e))
            if time.monotonic() - last >= self.every_s:
                last = time.monotonic()
                for line in self.lines():
                    self.echo(line)

    def _run_live(self) -> None:
        from rich.live import Live

        with Live(self.panel(), refresh_per_second=2, transient=False) as live:
            while not self.stop.wait(1.0):
                self._refresh()
                live.update(self.panel())
            self._refresh()
            live.update(self.panel())

    def lines(self) -> list[str]:
        """The plain form: one line of traffic, one per domain, head version and context length, the trainer's."""
        now = self.elapsed()
        rps, tps = self.stats.rates(now)
        out = [f"[{now:6.0f}s {self.phase_name(now)}] {rps:.2f} req/s {tps:.1f} tok/s | "
               f"{len(self.stats.snapshot())} requests, {self.stats.failures()} failed"]
        dom = self.stats.by(lambda r: r.domain, RECENT)
        heads = self.stats.by(lambda r: r.head_version)
        if dom:
            out.append("  accept length by domain (last 20): " + ", ".join(f"{d} {a:.3f} (n={n})"
                                                                          for d, (a, n) in dom.items()))
        if heads:
            out.append("  accept length by head: " + ", ".join(f"{h} {a:.3f} (n={n})" for h, (a, n) in heads.items()))
        if ctx := self.stats.by_context():
            out.append("  accept length by context: " + ", ".join(f"{b} {a:.3f} (n={n})" for b, (a, n) in ctx.items()))
        out.append("  " + trainer_line(self.status))
        return out

    def panel(self):
        from rich.console import Group
        from rich.panel import Panel
        from rich.table import Table

        now = self.elapsed()
        rps, tps = self.stats.rates(now)
        top = Table.grid(padding=(0, 3))
        top.add_row(f"[bold]{now:.0f}s[/] phase [bold]{self.phase_name(now)}[/]", f"{rps:.2f} req/s",
                    f"{tps:.1f} tok/s", f"{len(self.stats.snapshot())} requests",
                    f"[{'red' if self.stats.failures() else 'green'}]{self.stats.failures()} failed[/]")
        acc = Table(title="live accept length (tokens per verify step)", expand=False)
        for col in ("", "accept length", "requests"):
            acc.add_column(col)
        for d, (a, n) in self.stats.by(lambda r: r.domain, RECENT).items():
            acc.add_row(f"domain {d} (last {RECENT})", f"{a:.3f}", str(n))
        for h, (a, n) in self.stats.by(lambda r: r.head_version).items():
            acc.add_row(f"head {h}", f"{a:.3f}", str(n))
        for b, (a, n) in self.stats.by_context().items():
            acc.add_row(f"context {b} tokens", f"{a:.3f}", str(n))
        gates = Table(title="gate decisions (promotion log)", expand=True)
        gates.add_column("")
        for e in self.tail.events[-6:]:
            gates.add_row(event_line(e))
        return Panel(Group(top, acc, trainer_line(self.status), gates), title="adaptive-eagle demo")


__all__ = ["LiveStats", "LiveView", "LogTail", "event_line", "trainer_line"]
