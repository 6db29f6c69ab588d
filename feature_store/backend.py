"""What every store backend provides (the local Arrow-segment backend and the Redis-streams backend).

Backends move opaque payloads (Arrow IPC bytes from schema.py); they never decode records.

Errors a backend raises: `StoreUnavailable` when the store cannot be reached (connection refused, reset or
timed out; a local disk error), and its subclass `StoreRejected` when the store answered but refused
(Redis OOM under maxmemory, READONLY after a failover, NOAUTH / WRONGPASS, NOPERM from an ACL, LOADING).
The writer tells the two apart (state "down" vs "erroring"); callers that only care whether the store
took the data catch StoreUnavailable and get both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Protocol

from adaptive_eagle.atomic import atomic_write_text
from feature_store.config import StoreConfig

COUNTERS = ("dropped", "opted_out", "corrupt", "written", "write_errors")


class StoreUnavailable(ConnectionError):
    """The store cannot be reached or written right now (the writer drops and retries later)."""


class StoreRejected(StoreUnavailable):
    """The store answered but refused the command (OOM, READONLY, NOAUTH, NOPERM, ...); the message keeps
    the store's reason. `stored`: how many payloads of the refused `append` the store did take (a Redis
    pipeline is not a transaction: a batch can be cut by maxmemory half way)."""

    def __init__(self, message: str, stored: int = 0):
        super().__init__(message)
        self.stored = stored


@dataclass(frozen=True)
class Entry:
    id: str  # backend position: "<segment>-<byte offset>" (local) or a stream id (Redis)
    payload: bytes | None  # None: the entry exists but its payload is lost (counted as corrupt)
    created_ms: int | None = None  # write time where the backend knows it (Redis stream ids)


@dataclass(frozen=True)
class BackendStats:
    backend: str
    records: int  # entries stored now
    bytes: int  # payload bytes stored now (segments / stream payloads + spilled files)
    lag: int  # entries the group has not yet acknowledged (pending included)
    pending: int  # delivered to the group, not yet acknowledged
    counters: dict[str, int] = field(default_factory=dict)  # dropped, opted_out, corrupt, written, ...


class Backend(Protocol):
    def ping(self) -> None: ...
    def append(self, payloads: list[bytes]) -> None: ...
    def read(self, group: str, consumer: str, count: int, block_ms: int = 0) -> list[Entry]: ...
    def ack(self, group: str, ids: list[str]) -> None: ...
    def scan(self, since: float | None = None, until: float | None = None) -> Iterator[Entry]: ...
    def tail(self, n: int) -> list[Entry]: ...
    def add_counters(self, deltas: dict[str, int]) -> None: ...
    def stats(self, group: str | None = None) -> BackendStats: ...
    def maintain(self) -> None: ...
    def close(self) -> None: ...


def open_backend(config: StoreConfig, create: bool = True) -> Backend:
    """create=False for read-only use: a local store that does not exist raises StoreUnavailable."""
    if config.backend == "redis":
        from feature_store.redis_backend import RedisBackend

        return RedisBackend(config)
    from feature_store.local import LocalBackend

    return LocalBackend(config, create=create)


def atomic_write_json(path: Path, obj: dict, fsync: bool = True) -> None:
    """Write JSON so a crash leaves either the old or the new file, never a torn one."""
    atomic_write_text(path, json.dumps(obj), fsync=fsync)
