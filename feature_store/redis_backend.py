"""Redis-streams backend: one stream `<prefix>:<stream>`, consumer groups, Arrow IPC payloads.

Owns: the stream, its consumer groups, the counters hash `<prefix>:<stream>:stats`, and spilled
payload files under `<spill_dir>/<prefix>/<stream>/`. Must not touch: record contents.

Entry fields: `p` = the payload, or for payloads above `spill_threshold_bytes` a pointer
`ptr` (path relative to spill_dir), `n` (bytes), `crc` (crc32) to an Arrow IPC file written
atomically on shared storage. Caps: XADD MAXLEN [~] min(max_stream_len, max_stream_bytes / mean
entry bytes); TTL: XTRIM MINID [~] now - retention_s (stream ids are milliseconds). Delivery:
XREADGROUP, explicit XACK, and XAUTOCLAIM of entries pending longer than claim_idle_ms (a consumer
that died mid-batch) to the next consumer that reads.

Errors: Redis unreachable (refused, reset, timed out) raises StoreUnavailable; Redis answered but refused
(OOM under maxmemory, READONLY replica, NOAUTH / WRONGPASS, NOPERM, LOADING: redis-py's ResponseError and
its AuthenticationError / AuthorizationError / BusyLoadingError, which it files under ConnectionError)
raises StoreRejected with Redis's reason, e.g. "redis refused the write: OOM command not allowed ...".
"""

from __future__ import annotations

import threading
import time
import uuid
import zlib
from pathlib import Path
from typing import Iterator

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from adaptive_eagle.atomic import atomic_write_bytes
from feature_store.backend import COUNTERS, BackendStats, Entry, StoreRejected, StoreUnavailable
from feature_store.config import StoreConfig

# Redis answered and said no; caught before _ERRORS, since redis-py files some of them under ConnectionError
_REFUSED = (redis.ResponseError, redis.AuthenticationError, redis.exceptions.AuthorizationError,
            redis.BusyLoadingError)
_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)
SCAN_PAGE = 512
REASON_CHARS = 300


def _refused(what: str, e: Exception, stored: int = 0) -> StoreRejected:
    """StoreRejected for a refusal, with Redis's reason ("OOM command not allowed ...") and never a payload."""
    code = getattr(e, "status_code", None)
    reason = str(e.args[0]) if e.args else type(e).__name__
    if code and not reason.startswith(code):  # redis-py strips the error code off the message
        reason = f"{code} {reason}"
    return StoreRejected(f"redis refused the {what}: {reason[:REASON_CHARS]}", stored=stored)


def _client(cfg: StoreConfig) -> redis.Redis:
    kw: dict = dict(socket_timeout=cfg.socket_timeout_s, socket_connect_timeout=cfg.socket_timeout_s,
                    retry=Retry(NoBackoff(), 0))  # the writer owns backoff; never retry inside a call
    if cfg.redis_username:
        kw["username"] = cfg.redis_username
    if cfg.redis_password is not None:
        kw["password"] = cfg.redis_password.get_secret_value()
    url = cfg.redis_url
    if cfg.tls or url.startswith("rediss://"):
        # the URL's scheme picks the TLS connection class (an `ssl=True` keyword would reach the connection's
        # constructor and fail); the server's certificate and host name are checked unless tls_verify is off
        url = "rediss://" + url.removeprefix("redis://").removeprefix("rediss://")
        kw.update(ssl_ca_certs=cfg.tls_ca_file, ssl_certfile=cfg.tls_cert_file, ssl_keyfile=cfg.tls_key_file,
                  ssl_cert_reqs="required" if cfg.tls_verify else "none", ssl_check_hostname=cfg.tls_verify)
    return redis.Redis.from_url(url, **kw)


def _ms(entry_id: str) -> int:
    return int(entry_id.split("-")[0])


class RedisBackend:
    def __init__(self, config: StoreConfig):
        self.cfg = config
        self.key = config.key
        self.r = _client(config)
        self.spill_root = Path(config.spill_dir) / config.key_prefix / config.stream if config.spill_dir else None
        self._groups: set[str] = set()
        self._mean_bytes = 0.0  # running mean of entry bytes in the stream (for the bytes cap)
        self._lock = threading.Lock()

    def ping(self) -> None:
        try:
            self.r.ping()
        except _REFUSED as e:
            raise _refused("ping", e) from e
        except _ERRORS as e:
            raise StoreUnavailable(f"redis unreachable: {e}") from e

    # ---------- writing ----------
    def _spill(self, payload: bytes) -> dict:
        self.spill_root.mkdir(parents=True, exist_ok=True)
        name = f"{int(time.time() * 1000)}-{uuid.uuid4().hex}.arrows"
        atomic_write_bytes(self.spill_root / name, payload, fsync=False)  # as before: no fsync per spill
        rel = str((self.spill_root / name).relative_to(self.cfg.spill_dir))
        return {"ptr": rel, "n": len(payload), "crc": zlib.crc32(payload)}

    def _maxlen(self, entry_bytes: float) -> int:
        with self._lock:
            self._mean_bytes = entry_bytes if not self._mean_bytes else 0.9 * self._mean_bytes + 0.1 * entry_bytes
            by_bytes = int(self.cfg.max_stream_bytes // max(self._mean_bytes, 1.0))
        return max(1, min(self.cfg.max_stream_len, by_bytes))

    def append(self, payloads: list[bytes]) -> None:
        """XADD every payload in one pipeline (not a transaction: a refusal can cut a batch half way, and
        the StoreRejected then says how many were stored)."""
        try:
            pipe = self.r.pipeline(transaction=False)
            for p in payloads:
                big = self.spill_root is not None and len(p) > self.cfg.spill_threshold_bytes
                fields = self._spill(p) if big else {"p": p}
                maxlen = self._maxlen(64 if big else len(p))
                pipe.xadd(self.key, fields, maxlen=maxlen, approximate=self.cfg.trim_approximate)
            results = pipe.execute(raise_on_error=False)
        except _REFUSED as e:
            raise _refused("write", e) from e
        except _ERRORS as e:
            raise StoreUnavailable(f"redis write failed: {e}") from e
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            raise _refused("write", errors[0], stored=len(results) - len(errors))

    # ---------- reading ----------
    def _ensure_group(self, group: str) -> None:
        if group in self._groups:
            return
        try:
            self.r.xgroup_create(self.key, group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._groups.add(group)

    def _payload(self, fields: dict | None) -> bytes | None:
        if not fields:
            return None
        if b"p" in fields:
            return fields[b"p"]
        if b"ptr" in fields and self.cfg.spill_dir:
            try:
                data = (Path(self.cfg.spill_dir) / fields[b"ptr"].decode()).read_bytes()
            except (OSError, UnicodeDecodeError):
                return None
            if len(data) == int(fields.get(b"n", -1)) and zlib.crc32(data) == int(fields.get(b"crc", -1)):
                return data
        return None

    def _entries(self, raw) -> list[Entry]:
        out = []
        for eid, fields in raw or ():
            eid = eid.decode() if isinstance(eid, bytes) else eid
            out.append(Entry(eid, self._payload(fields), _ms(eid)))
        return out

    def read(self, group: str, consumer: str, count: int = 64, block_ms: int = 0) -> list[Entry]:
        """Pending entries idle past claim_idle_ms first (XAUTOCLAIM), then new ones (XREADGROUP)."""
        try:
            try:
                return self._read(group, consumer, count, block_ms)
            except redis.ResponseError as e:
                if "NOGROUP" not in str(e):  # the stream was lost (e.g. Redis restarted without persistence)
                    raise
                self._groups.discard(group)
                return self._read(group, consumer, count, block_ms)
        except _REFUSED as e:
            raise _refused("read", e) from e
        except _ERRORS as e:
            raise StoreUnavailable(f"redis read failed: {e}") from e

    def _read(self, group: str, consumer: str, count: int, block_ms: int) -> list[Entry]:
        self._ensure_group(group)
        claimed = self.r.xautoclaim(self.key, group, consumer, self.cfg.claim_idle_ms, "0-0", count=count)
        out = self._entries(claimed[1])
        if len(out) < count:
            block = min(block_ms, int(self.cfg.socket_timeout_s * 1000 * 0.8)) or None
            res = self.r.xreadgroup(group, consumer, {self.key: ">"}, count=count - len(out), block=block)
            for _, raw in res or ():
                out += self._entries(raw)
        return out

    def ack(self, group: str, ids: list[str]) -> None:
        if ids:
            try:
                self.r.xack(self.key, group, *ids)
            except _REFUSED as e:
                raise _refused("ack", e) from e
            except _ERRORS as e:
                raise StoreUnavailable(f"redis ack failed: {e}") from e

    def scan(self, since: float | None = None, until: float | None = None) -> Iterator[Entry]:
        # stream ids are write times (>= a record's created_at): `since` bounds them, `until` cannot
        lo = f"{int(since * 1000)}-0" if since is not None else "-"
        hi = "+"
        while True:
            page = self._entries(self.r.xrange(self.key, lo, hi, count=SCAN_PAGE))
            yield from page
            if len(page) < SCAN_PAGE:
                return
            lo = f"({page[-1].id}"

    def tail(self, n: int) -> list[Entry]:
        return list(reversed(self._entries(self.r.xrevrange(self.key, "+", "-", count=n)))) if n > 0 else []

    # ---------- counters, stats, retention ----------
    def add_counters(self, deltas: dict[str, int]) -> None:
        deltas = {k: int(v) for k, v in deltas.items() if v}
        if not deltas:
            return
        try:
            pipe = self.r.pipeline(transaction=False)
            for k, v in deltas.items():
                pipe.hincrby(self.cfg.stats_key, k, v)
            pipe.execute()
        except _REFUSED as e:
            raise _refused("counters", e) from e
        except _ERRORS as e:
            raise StoreUnavailable(f"redis counters failed: {e}") from e

    def counters(self) -> dict[str, int]:
        cur = {k: 0 for k in COUNTERS}
        cur.update({k.decode(): int(v) for k, v in self.r.hgetall(self.cfg.stats_key).items()})
        return cur

    def stream_payload_bytes(self) -> int:
        """Bytes of the entries' fields in the stream (pointers for spilled payloads)."""
        total = 0
        lo = "-"
        while True:
            page = self.r.xrange(self.key, lo, "+", count=SCAN_PAGE)
            total += sum(sum(len(k) + len(v) for k, v in f.items()) for _, f in page)
            if len(page) < SCAN_PAGE:
                return total
            lo = f"({page[-1][0].decode()}"

    def _spill_files(self) -> list[Path]:
        if self.spill_root is None or not self.spill_root.is_dir():
            return []
        return sorted(self.spill_root.glob("*.arrows"))  # names start with the write time in ms

    def stats(self, group: str | None = None) -> BackendStats:
        try:
            records = self.r.xlen(self.key)
            nbytes = (self.r.memory_usage(self.key, samples=0) or 0) + sum(
                p.stat().st_size for p in self._spill_files())
            lag = pending = 0
            if group is not None:
                self._ensure_group(group)
                info = next((g for g in self.r.xinfo_groups(self.key) if g["name"].decode() == group), {})
                pending = int(info.get("pending", 0))
                lag = pending + (int(info["lag"]) if info.get("lag") is not None else records)
            return BackendStats("redis", records, nbytes, lag, pending, self.counters())
        except _REFUSED as e:
            raise _refused("stats", e) from e
        except _ERRORS as e:
            raise StoreUnavailable(f"redis stats failed: {e}") from e

    def maintain(self, now: float | None = None) -> None:
        """TTL on the stream (XTRIM MINID) and on spilled files; byte cap on the spill directory."""
        now = time.time() if now is None else now
        try:
            self.r.xtrim(self.key, minid=f"{int((now - self.cfg.retention_s) * 1000)}-0",
                         approximate=self.cfg.trim_approximate)
        except _REFUSED as e:
            raise _refused("trim", e) from e
        except _ERRORS as e:
            raise StoreUnavailable(f"redis trim failed: {e}") from e
        files = self._spill_files()
        sizes = [p.stat().st_size for p in files]
        total = sum(sizes)
        for p, size in zip(files, sizes):
            if now - int(p.name.split("-")[0]) / 1000 > self.cfg.retention_s or total > self.cfg.spill_max_bytes:
                p.unlink(missing_ok=True)
                total -= size

    def close(self) -> None:
        self.r.close()
