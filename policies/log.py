"""The promotion log: ``promotions.jsonl``, append-only, one JSON object per line, one line per decision.

Owns: the log's line format (``PromotionEvent``, pydantic: it crosses processes and outlives them), the
append (O_APPEND, one write per line, fsync) and the tolerant reader. Must not touch: decisions (gates,
controller), the registry, rendering (``policies.render``).

Events, in the order a story is told: ``considered`` (a candidate arrived), ``canary_started``,
``canary_ended``, ``promoted``, ``watch_ended``, ``rejected``, ``rolled_back``, ``pinned``, ``unpinned``.
A line carries the time, the event, the candidate, the champion before the event, the gate's action,
its one-sentence reason, who acted (``policy`` or ``on-call``) and the evidence (gate numbers, interval,
sample counts, per-domain table).

Readers never crash on the log: a line that is not JSON, or not an event (a torn write, a hand edit), is
skipped, counted in ``LogRead.skipped`` and reported as one warning with the line numbers.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger(__name__)

EventKind = Literal["considered", "canary_started", "canary_ended", "promoted", "watch_ended", "rejected",
                    "rolled_back", "pinned", "unpinned"]
EVENTS: tuple[str, ...] = EventKind.__args__  # type: ignore[attr-defined]
LOG_NAME = "promotions.jsonl"


def utc_now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class PromotionEvent(BaseModel):
    """One line of promotions.jsonl."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    time: str = Field(default_factory=utc_now_iso, min_length=1, description="ISO-8601 UTC time of the event")
    event: EventKind = Field(description="what happened")
    candidate: str | None = Field(None, description="the version the event is about ('none': plain decoding)")
    champion: str | None = Field(None, description="the champion before the event")
    action: str | None = Field(None, description="the gate's action (promote, reject, continue, rollback, hold)")
    reason: str = Field("", description="one sentence an on-call engineer reads")
    by: str = Field("policy", min_length=1, description="who acted: 'policy' (the controller) or 'on-call'")
    evidence: dict = Field(default_factory=dict, description="gate numbers, interval, sample counts, domains")

    def line(self) -> str:
        """The JSON line (no newline): strict JSON, so a NaN or an infinity in the evidence becomes null."""
        return json.dumps(_strict_json(self.model_dump()), sort_keys=True, allow_nan=False, default=str,
                          separators=(",", ":"))


def _strict_json(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _strict_json(value.item())
    return value


@dataclass(frozen=True)
class LogRead:
    """What a read found: the events in file order and how many lines were skipped (with their numbers)."""

    events: tuple[PromotionEvent, ...]
    skipped: int
    skipped_lines: tuple[int, ...] = ()  # 1-based line numbers


def _parse(text: str) -> PromotionEvent | None:
    try:
        return PromotionEvent.model_validate(json.loads(text))
    except (ValueError, ValidationError, TypeError):  # json.JSONDecodeError is a ValueError
        return None


class PromotionLog:
    """promotions.jsonl at `path`. Appends create the file (not its directory); reads never create anything."""

    def __init__(self, path: str | os.PathLike, *, fsync: bool = True) -> None:
        self.path = Path(path)
        self.fsync = fsync

    # ---- writing ----------------------------------------------------------------------------------
    def append(self, event: PromotionEvent) -> PromotionEvent:
        """Append one line: O_APPEND (concurrent writers never overwrite each other), the whole line in one
        write, fsync before returning. The directory must exist (a mistyped path is an error, not a tree)."""
        if not self.path.parent.is_dir():
            raise FileNotFoundError(f"{self.path.parent}: directory of the promotion log does not exist")
        data = (event.line() + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            written = os.write(fd, data)
            while written < len(data):  # a short write (rare: signals, full disks) finishes the same line
                written += os.write(fd, data[written:])
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return event

    def record(self, event: EventKind, **fields) -> PromotionEvent:
        """Build and append one event (fields as in PromotionEvent)."""
        return self.append(PromotionEvent(event=event, **fields))

    # ---- reading ----------------------------------------------------------------------------------
    def _require(self) -> None:
        if not self.path.is_file():
            what = "is not a file" if self.path.exists() else "does not exist"
            raise FileNotFoundError(f"{self.path}: promotion log {what} (check --log; the controller writes "
                                    f"{LOG_NAME} next to the registry it manages)")

    def read(self) -> LogRead:
        """Every event; corrupt lines skipped and counted (one warning names their numbers). Blank lines are
        ignored. A missing file is FileNotFoundError (reads create nothing)."""
        self._require()
        events, bad = [], []
        with open(self.path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                text = raw.decode("utf-8", errors="replace").strip()
                if not text:
                    continue
                event = _parse(text)
                if event is None:
                    bad.append(number)
                else:
                    events.append(event)
        if bad:
            log.warning("%s: skipped %d corrupt line(s): %s", self.path, len(bad), ", ".join(map(str, bad[:20])))
        return LogRead(events=tuple(events), skipped=len(bad), skipped_lines=tuple(bad))

    def follow(self, *, poll_s: float = 0.5, from_start: bool = True, stop=None) -> Iterator[PromotionEvent]:
        """Yield events as they are appended (like tail -f). A line is read only once its newline arrived;
        corrupt complete lines are skipped with a warning. `stop()` returning True ends the loop (tests);
        without it the generator runs until closed."""
        self._require()
        with open(self.path, "rb") as f:
            if not from_start:
                f.seek(0, os.SEEK_END)
            pending = b""
            while stop is None or not stop():
                chunk = f.readline()
                if not chunk:
                    time.sleep(poll_s)
                    continue
                pending += chunk
                if not pending.endswith(b"\n"):
                    continue  # the rest of the line is still being written
                text, pending = pending.decode("utf-8", errors="replace").strip(), b""
                if not text:
                    continue
                event = _parse(text)
                if event is None:
                    log.warning("%s: skipped a corrupt line", self.path)
                    continue
                yield event


__all__ = ["EVENTS", "LOG_NAME", "EventKind", "LogRead", "PromotionEvent", "PromotionLog", "utc_now_iso"]
