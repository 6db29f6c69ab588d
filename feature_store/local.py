"""Local Arrow-segment backend: the embedded default, no server.

Owns: segment files under `<root>/segments/`, consumer offsets under `<root>/offsets/`, shared
counters in `<root>/counters.json`. Must not touch: record contents (payloads are opaque bytes).

Segment layout: an 8-byte header `AESEG1\\n\\0`, then frames `[u32 length][u32 crc32][payload]`
(little-endian; payload = one Arrow IPC stream). A frame cut short at the end of the last segment is
"not yet written" for readers and truncated away when a writer opens the store; a short frame at the
end of an older segment, or a CRC mismatch, is skipped and counted as corrupt, never returned.
Ids are `<segment>-<byte offset>`. One writer process at a time (an flock on `writer.lock`).

Errors: a disk that refuses (full, over quota, read-only, no permission) or a store another process
writes to raises StoreRejected (a ping cannot see either); any other OS error raises StoreUnavailable.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from feature_store.backend import COUNTERS, BackendStats, Entry, StoreRejected, StoreUnavailable, atomic_write_json
from feature_store.config import StoreConfig

MAGIC = b"AESEG1\n\0"
HEADER = len(MAGIC)
REFUSED_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
FRAME = struct.Struct("<II")
MAX_FRAME = 1 << 30
Pos = tuple[int, int]  # (segment, byte offset)


def _id(pos: Pos) -> str:
    return f"{pos[0]}-{pos[1]}"


def _pos(entry_id: str) -> Pos:
    seg, off = entry_id.split("-")
    return int(seg), int(off)


@dataclass
class _Group:
    commit: Pos  # everything before this is acknowledged (persisted)
    cursor: Pos  # next never-delivered position
    pending: dict[Pos, float] = field(default_factory=dict)  # delivered, unacked -> delivery time


class LocalBackend:
    def __init__(self, config: StoreConfig, create: bool = True):
        """create=False (read-only commands): a directory that holds no store is an error, never made."""
        self.cfg = config
        self.root = Path(config.local_root)
        self.seg_dir = self.root / "segments"
        self.off_dir = self.root / "offsets"
        if not create and not self.seg_dir.is_dir():
            raise StoreUnavailable(f"{self.root}: no feature store here (no segments/ directory); check the path")
        for d in (self.seg_dir, self.off_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._groups: dict[str, _Group] = {}
        self._active = None  # append file handle
        self._active_seg = -1
        self._active_opened = 0.0
        self._writer_lock_fd: int | None = None

    # ---------- segments ----------
    def _segments(self) -> list[int]:
        return sorted(int(p.name[4:-9]) for p in self.seg_dir.glob("seg-*.arrowseg"))

    def _path(self, seg: int) -> Path:
        return self.seg_dir / f"seg-{seg:010d}.arrowseg"

    def _scan_frames(self, seg: int, start: int, last: bool) -> Iterator[tuple[int, bytes | None, int]]:
        """Yield (offset, payload or None if corrupt, next offset). Stops at a torn tail."""
        try:
            f = open(self._path(seg), "rb")
        except FileNotFoundError:
            return
        with f:
            if f.read(HEADER) != MAGIC:
                yield HEADER, None, -1  # not a segment: the caller skips the whole file
                return
            pos = max(start, HEADER)
            f.seek(pos)
            while True:
                head = f.read(FRAME.size)
                if len(head) < FRAME.size:
                    if head and not last:
                        yield pos, None, -1
                    return
                n, crc = FRAME.unpack(head)
                payload = f.read(n) if n <= MAX_FRAME else b""
                if n > MAX_FRAME or len(payload) < n:
                    if not last:
                        yield pos, None, -1  # torn tail of an older segment
                    return
                nxt = pos + FRAME.size + n
                yield pos, (payload if zlib.crc32(payload) == crc else None), nxt
                pos = nxt

    def _valid_end(self, seg: int) -> int:
        end = HEADER  # end of the last complete frame (a CRC-bad complete frame is kept; readers skip it)
        for _, _, nxt in self._scan_frames(seg, HEADER, last=True):
            if nxt < 0:
                break
            end = nxt
        return end

    # ---------- writing ----------
    def _acquire_writer(self) -> None:
        if self._writer_lock_fd is not None:
            return
        fd = os.open(self.root / "writer.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise StoreRejected(f"another process writes to {self.root}") from None
        self._writer_lock_fd = fd

    def _open_active(self) -> None:
        """Open the last segment for append after truncating a torn tail, or start a new one."""
        self._acquire_writer()
        segs = self._segments()
        if segs:
            seg = segs[-1]
            size = self._path(seg).stat().st_size
            end = self._valid_end(seg) if size >= HEADER else 0
            if end < size:
                with open(self._path(seg), "r+b") as f:
                    f.truncate(end)
                self.add_counters({"corrupt": 1})
            if HEADER <= end < self.cfg.segment_bytes:
                self._active = open(self._path(seg), "ab")
                self._active_seg, self._active_opened = seg, time.time()
                return
        self._rotate((segs[-1] + 1) if segs else 0)

    def _rotate(self, seg: int) -> None:
        if self._active is not None:
            self._active.close()
        f = open(self._path(seg), "ab")
        f.write(MAGIC)
        f.flush()
        self._active, self._active_seg, self._active_opened = f, seg, time.time()

    def append(self, payloads: list[bytes]) -> None:
        with self._lock:
            try:
                if self._active is None:
                    self._open_active()
                f = self._active
                if (f.tell() >= self.cfg.segment_bytes
                        or time.time() - self._active_opened > self.cfg.segment_max_age_s):
                    self._rotate(self._active_seg + 1)
                    f = self._active
                f.write(b"".join(FRAME.pack(len(p), zlib.crc32(p)) + p for p in payloads))
                f.flush()
                if self.cfg.fsync:
                    os.fsync(f.fileno())
            except StoreUnavailable:  # an OSError too (ConnectionError): keep its kind and message
                self._active = None
                raise
            except OSError as e:
                self._active = None
                if e.errno in REFUSED_ERRNOS:
                    raise StoreRejected(f"local store refused the write: {e}") from e
                raise StoreUnavailable(f"local store write failed: {e}") from e

    def ping(self) -> None:
        if not self.seg_dir.is_dir():
            raise StoreUnavailable(f"{self.seg_dir} is gone")

    # ---------- reading ----------
    def _group(self, group: str) -> _Group:
        g = self._groups.get(group)
        if g is None:
            path = self.off_dir / f"{group}.json"
            pos = (0, HEADER)
            if path.exists():
                d = json.loads(path.read_text())
                pos = (int(d["segment"]), int(d["offset"]))
            g = self._groups[group] = _Group(commit=pos, cursor=pos)
        return g

    def _payload_at(self, pos: Pos) -> bytes | None:
        for off, payload, _ in self._scan_frames(pos[0], pos[1], last=True):
            return payload if off == pos[1] else None
        return None

    def _iter_from(self, start: Pos) -> Iterator[tuple[Pos, bytes | None, Pos]]:
        """Frames at or after `start` across segments: (pos, payload or None if corrupt, next pos).
        A torn tail of an older segment comes out once as a corrupt frame whose next pos is the next
        segment."""
        segs = self._segments()
        for seg in (s for s in segs if s >= start[0]):
            off = start[1] if seg == start[0] else HEADER
            for pos, payload, nxt in self._scan_frames(seg, off, last=seg == segs[-1]):
                if nxt < 0:
                    yield (seg, pos), None, (seg + 1, HEADER)
                    break
                yield (seg, pos), payload, (seg, nxt)

    def read(self, group: str, consumer: str = "c0", count: int = 64, block_ms: int = 0) -> list[Entry]:
        """Up to `count` entries: idle pending entries first (re-delivery), then new ones."""
        deadline = time.monotonic() + block_ms / 1000
        while True:
            with self._lock:
                out = self._read_once(group, count)
            if out or time.monotonic() >= deadline:
                return out
            time.sleep(min(0.02, max(0.0, deadline - time.monotonic())))

    def _read_once(self, group: str, count: int) -> list[Entry]:
        g = self._group(group)
        now = time.time()
        out: list[Entry] = []
        idle = self.cfg.claim_idle_ms / 1000
        for pos, t in sorted(g.pending.items()):
            if len(out) >= count:
                return out
            if now - t >= idle:
                payload = self._payload_at(pos)
                if payload is None:  # deleted by retention meanwhile
                    g.pending.pop(pos)
                    continue
                g.pending[pos] = now
                out.append(Entry(_id(pos), payload))
        for pos, payload, nxt in self._iter_from(g.cursor):
            if len(out) >= count:
                break
            g.cursor = nxt
            if payload is None:  # corrupt frame: counted, never returned; acts as acknowledged
                self.add_counters({"corrupt": 1})
                continue
            g.pending[pos] = now
            out.append(Entry(_id(pos), payload))
        if not g.pending:
            self._commit(group, g, g.cursor)
        return out

    def ack(self, group: str, ids: list[str]) -> None:
        with self._lock:
            g = self._group(group)
            for i in ids:
                g.pending.pop(_pos(i), None)
            self._commit(group, g, min(g.pending) if g.pending else g.cursor)

    def _commit(self, group: str, g: _Group, pos: Pos) -> None:
        if pos != g.commit:
            g.commit = pos
            atomic_write_json(self.off_dir / f"{group}.json", {"segment": pos[0], "offset": pos[1]}, self.cfg.fsync)

    def scan(self, since: float | None = None, until: float | None = None) -> Iterator[Entry]:
        """Every stored entry in write order (no group, no ack). Time filters are the reader's job."""
        for pos, payload, _ in self._iter_from((0, HEADER)):
            yield Entry(_id(pos), payload)

    def tail(self, n: int) -> list[Entry]:
        """The newest n entries, oldest first."""
        out: list[Entry] = []
        for seg in reversed(self._segments()):
            if len(out) >= n:
                break
            frames = [Entry(_id((seg, p)), pl) for p, pl, nxt in self._scan_frames(seg, HEADER, True) if nxt >= 0]
            out = frames + out
        return out[-n:] if n > 0 else []

    # ---------- counters, stats, retention ----------
    def add_counters(self, deltas: dict[str, int]) -> None:
        deltas = {k: int(v) for k, v in deltas.items() if v}
        if not deltas:
            return
        path = self.root / "counters.json"
        fd = os.open(self.root / "counters.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            cur = self.counters()
            for k, v in deltas.items():
                cur[k] = cur.get(k, 0) + v
            atomic_write_json(path, cur, fsync=False)
        finally:
            os.close(fd)

    def counters(self) -> dict[str, int]:
        path = self.root / "counters.json"
        cur = {k: 0 for k in COUNTERS}
        if path.exists():
            cur.update(json.loads(path.read_text()))
        return cur

    def stats(self, group: str | None = None) -> BackendStats:
        with self._lock:
            total = sum(1 for _, pl, _ in self._iter_from((0, HEADER)) if pl is not None)
            nbytes = sum(self._path(s).stat().st_size for s in self._segments())
            lag = pending = 0
            if group is not None:
                g = self._group(group)
                pending = len(g.pending)
                lag = pending + sum(1 for _, pl, _ in self._iter_from(g.cursor) if pl is not None)
            return BackendStats("local", total, nbytes, lag, pending, self.counters())

    def maintain(self, now: float | None = None) -> None:
        """Retention: drop closed segments older than retention_s, then the oldest past local_max_bytes."""
        now = time.time() if now is None else now
        with self._lock:
            segs = [s for s in self._segments() if s != self._active_seg]
            if self._active_seg < 0 and segs:
                segs = segs[:-1]  # never the newest segment (a writer may be appending to it)
            sizes = {s: self._path(s).stat().st_size for s in self._segments()}
            total = sum(sizes.values())
            for s in segs:
                old = now - self._path(s).stat().st_mtime > self.cfg.retention_s
                if old or total > self.cfg.local_max_bytes:
                    self._path(s).unlink(missing_ok=True)
                    total -= sizes[s]

    def close(self) -> None:
        with self._lock:
            if self._active is not None:
                self._active.close()
                self._active = None
            if self._writer_lock_fd is not None:
                os.close(self._writer_lock_fd)
                self._writer_lock_fd = None
