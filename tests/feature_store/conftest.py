"""Feature-store fixtures: a real redis-server (the one `make test` started, or our own), record
factories, and a helper that spawns a dedicated redis-server a test may kill."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from adaptive_eagle.trace import TraceRecord, VerifyStep
from feature_store.config import StoreConfig


class StubBackend:
    """The housekeeping of a backend a writer test stands in for (counters, retention, close): nothing to do.
    Test stores subclass it and define `append` and `ping`, the calls the test is about."""

    def add_counters(self, deltas):
        pass

    def maintain(self):
        pass

    def close(self):
        pass

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_redis(port: int, workdir: Path, *extra: str) -> subprocess.Popen:
    """A redis-server on 127.0.0.1:port (no persistence); waits (bounded) until it answers."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (make redis-server)")
    workdir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir),
                             "--save", "", "--appendonly", "no", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60  # a start on a loaded machine is slow; only a hang fails
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    pytest.fail(f"redis-server did not start on port {port}")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    url = os.environ.get("ADAPTIVE_EAGLE_TEST_REDIS_URL")
    if url:
        yield url
        return
    port = free_port()
    proc = spawn_redis(port, tmp_path_factory.mktemp("redis"))
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def redis_cfg(redis_url, tmp_path):
    """A Redis StoreConfig with a key prefix of its own (tests share one server)."""
    def make(**kw) -> StoreConfig:
        base = dict(backend="redis", redis_url=redis_url, key_prefix=f"t{uuid.uuid4().hex[:10]}",
                    spill_dir=str(tmp_path / "spill"), flush_interval_s=0.01, backoff_initial_s=0.02,
                    backoff_max_s=0.2, socket_timeout_s=1.0)
        base.update(kw)
        return StoreConfig(**base)
    return make


@pytest.fixture
def local_cfg(tmp_path):
    def make(**kw) -> StoreConfig:
        base = dict(backend="local", local_root=str(tmp_path / "store"), flush_interval_s=0.01, fsync=False)
        base.update(kw)
        return StoreConfig(**base)
    return make


def make_record(i: int = 0, tokens: int = 12, hidden: int | None = 8, n_aux: int = 3, **kw) -> TraceRecord:
    rng = np.random.default_rng(i)
    prompt = tokens // 2
    aux = None
    if hidden:
        aux = rng.standard_normal((tokens, n_aux * hidden)).astype(np.float32)
    base = dict(request_id=f"req-{i}", target_fingerprint="fp0", head_version="v1", backend="reference",
                input_ids=tuple(int(t) for t in rng.integers(0, 49152, tokens)),
                loss_mask=(0,) * prompt + (1,) * (tokens - prompt),
                steps=(VerifyStep(6, 2, 2, 17, 0.25, 0.5), VerifyStep(6, 6, 6)),
                domain="code" if i % 2 else "english", aux_hidden=aux,
                aux_layer_ids=(2, 15, 27) if hidden else (), created_at=1_700_000_000.0 + i)
    base.update(kw)
    return TraceRecord(**base)


def wait_until(pred, timeout: float = 10.0, every: float = 0.02):
    """Poll pred() until truthy or the (bounded) timeout; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() >= deadline:
            return v
        time.sleep(every)
