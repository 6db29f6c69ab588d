"""LoadSignal: the gateway's load, shared with a trainer on the same machine through one small file,
so the trainer pauses while requests wait (two cores: a training step must not starve a request).

Owns: the file's format (`{"waiting", "busy", "at"}`, replaced atomically), `publish` (the gateway's
side) and `__call__` (the trainer's `yield_to` hook: True = wait). Must not touch: the trainer and
the router themselves. A file because both sides can read it without Ray and without a network call
per training step; a stack spans one machine for this (the trainer sits on the gateway's node). A
signal older than `stale_s` (the gateway stopped) never holds the trainer back.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from adaptive_eagle.atomic import atomic_write_text


@dataclass(frozen=True)
class LoadSignal:
    path: str
    queue_depth: int = 1  # the trainer yields while at least this many requests wait (0: never)
    when_busy: bool = False  # ... or while any replica decodes
    stale_s: float = 5.0  # an older signal is ignored

    def publish(self, waiting: int, busy: int) -> None:
        atomic_write_text(self.path, json.dumps({"waiting": int(waiting), "busy": int(busy), "at": time.time()}),
                          fsync=False)

    def read(self) -> Optional[dict]:
        try:
            data = json.loads(Path(self.path).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) and time.time() - float(data.get("at", 0)) <= self.stale_s else None

    def __call__(self) -> bool:
        """The trainer's yield_to: True while requests wait (or, with when_busy, while a replica decodes)."""
        data = self.read()
        if data is None:
            return False
        waiting = self.queue_depth > 0 and int(data.get("waiting", 0)) >= self.queue_depth
        return waiting or (self.when_busy and int(data.get("busy", 0)) > 0)

    def clear(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class LoadPublisher:
    """Publishes a router's load every `interval_s` (on change at once, else as a heartbeat each second);
    `step()` is one look, for a thread or a loop to call."""

    def __init__(self, signal: LoadSignal, router, heartbeat_s: float = 1.0) -> None:
        self.signal, self.router, self.heartbeat_s = signal, router, heartbeat_s
        self._last: tuple[int, int] | None = None
        self._at = 0.0

    def step(self) -> None:
        now, load = time.monotonic(), (self.router.waiting, self.router.busy)
        if load != self._last or now - self._at >= self.heartbeat_s:
            self.signal.publish(*load)
            self._last, self._at = load, now


__all__ = ["LoadPublisher", "LoadSignal"]
