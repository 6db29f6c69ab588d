"""StoreConfig: the one pydantic model that configures the feature store (it crosses config files
and processes). Immutable after construction; every field documented and range-checked.
`store_config_from_options`: the StoreConfig that a command line's store options name (every command that
reads a store takes the same three)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_serializer, model_validator

from feature_store.codecs import DEFAULT_CODEC


REVEAL_SECRETS = "reveal_secrets"  # serialization context key: the real password in a JSON dump


class StoreConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: Literal["local", "redis"] = Field("local", description="local Arrow segments (embedded) or Redis")
    codec: str = Field(DEFAULT_CODEC, description="hidden-state codec name (feature_store.codecs.CODECS)")

    # local backend
    local_root: Optional[str] = Field(None, description="directory of the local backend (segments, offsets)")
    segment_bytes: int = Field(64 << 20, ge=4096, description="rotate the active segment past this size")
    segment_max_age_s: float = Field(3600.0, gt=0, description="rotate the active segment past this age")
    fsync: bool = Field(True, description="fsync segment appends and offset files (crash safety)")

    # redis backend
    redis_url: str = Field("redis://127.0.0.1:6379/0", description="redis:// or rediss:// URL")
    redis_username: Optional[str] = Field(None, description="ACL user for AUTH (None: default user)")
    redis_password: Optional[SecretStr] = Field(None, description="AUTH password (never logged)")
    tls: bool = Field(False, description="connect with TLS (also implied by a rediss:// URL)")
    tls_ca_file: Optional[str] = Field(None, description="CA bundle to verify the server")
    tls_cert_file: Optional[str] = Field(None, description="client certificate (mutual TLS)")
    tls_key_file: Optional[str] = Field(None, description="client key (mutual TLS)")
    tls_verify: bool = Field(True, description="verify the server certificate")
    key_prefix: str = Field("ae", min_length=1, description="prefix of every Redis key")
    stream: str = Field("traces", min_length=1, description="stream name under the prefix")
    socket_timeout_s: float = Field(2.0, gt=0, description="Redis socket and connect timeout")
    spill_dir: Optional[str] = Field(None, description="shared directory for large payloads (None: never spill)")
    spill_threshold_bytes: int = Field(256 << 10, ge=1, description="payloads above this go to spill_dir")
    spill_max_bytes: int = Field(8 << 30, ge=1, description="cap on bytes in spill_dir; oldest files go first")
    max_stream_len: int = Field(200_000, ge=1, description="cap on stream entries (XADD MAXLEN)")
    max_stream_bytes: int = Field(2 << 30, ge=1, description="cap on stream payload bytes (via an entry cap)")
    trim_approximate: bool = Field(True, description="MAXLEN ~ (cheap; may overshoot by one stream node)")
    claim_idle_ms: int = Field(60_000, ge=1, description="pending entries idle this long are re-delivered")

    # both backends
    retention_s: float = Field(7 * 86400.0, gt=0, description="TTL: data older than this is deleted")
    local_max_bytes: int = Field(16 << 30, ge=4096, description="local backend: cap on segment bytes")

    # writer
    queue_max_records: int = Field(1024, ge=1, description="bounded put() queue (records); full: drop")
    queue_max_bytes: int = Field(256 << 20, ge=1, description="bounded put() queue (bytes); full: drop")
    batch_max_records: int = Field(64, ge=1, description="records per backend write")
    flush_interval_s: float = Field(0.05, gt=0, description="the flusher wakes at least this often")
    backoff_initial_s: float = Field(0.05, gt=0, description="first reconnect delay")
    backoff_max_s: float = Field(5.0, gt=0, description="reconnect delay cap (doubles up to here)")

    @field_serializer("redis_password", when_used="json")
    def _password_json(self, value: Optional[SecretStr], info) -> Optional[str]:
        """Masked in JSON, unless the dump is the config handed to another process of the stack (the trainer
        actor gets its config as JSON): `model_dump_json(context={REVEAL_SECRETS: True})`."""
        if value is None:
            return None
        return value.get_secret_value() if (info.context or {}).get(REVEAL_SECRETS) else str(value)

    @model_validator(mode="after")
    def _check(self) -> "StoreConfig":
        if self.backend == "local" and not self.local_root:
            raise ValueError("backend 'local' needs local_root")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff_max_s < backoff_initial_s")
        from feature_store.codecs import CODECS

        if self.codec not in CODECS:
            raise ValueError(f"unknown codec {self.codec!r}; known: {sorted(CODECS)}")
        return self

    @property
    def key(self) -> str:
        return f"{self.key_prefix}:{self.stream}"

    @property
    def stats_key(self) -> str:
        return f"{self.key_prefix}:{self.stream}:stats"

    @classmethod
    def from_file(cls, path: str | Path) -> "StoreConfig":
        return cls.model_validate(json.loads(Path(path).read_text()))


class StoreConfigError(ValueError):
    """Store options that name no valid store: a config file that cannot be read, or values out of range."""


def store_config_from_options(config_file: str | Path | None = None, root: str | Path | None = None,
                              redis_url: str | None = None, prefix: str = "ae") -> Optional[StoreConfig]:
    """The StoreConfig of a command line's store options, in this order: a StoreConfig JSON file, a Redis URL
    (keys under `prefix`), a local backend directory. None when none of them is given (the command says which
    options it takes). Raises StoreConfigError for a file that cannot be read or options that do not validate."""
    try:
        if config_file is not None:
            return StoreConfig.from_file(config_file)
        if redis_url:
            return StoreConfig(backend="redis", redis_url=redis_url, key_prefix=prefix)
        if root is not None:
            return StoreConfig(backend="local", local_root=str(root))
    except (ValidationError, OSError, ValueError) as e:
        raise StoreConfigError(f"bad store config: {e}") from e
    return None
