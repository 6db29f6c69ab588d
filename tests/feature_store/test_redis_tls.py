"""Redis over TLS, for real: a redis-server with a TLS port and AUTH on loopback, its certificate made by
ops/scripts/redis-tls-cert.sh (the one the cluster's head node makes), and capture written and read back
through it with the client checking the server's certificate AND its host name (redis-py's default). A
certificate without a subjectAltName for the address is refused: host-name checking is really on."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from feature_store.backend import open_backend
from feature_store.config import StoreConfig
from feature_store.reader import StoreReader
from feature_store.writer import write_records
from tests.feature_store.conftest import free_port, make_record, spawn_redis

SCRIPT = Path(__file__).resolve().parents[2] / "ops" / "scripts" / "redis-tls-cert.sh"
PASSWORD = "tls-test-password"

pytestmark = pytest.mark.redis


def tls_redis(tmp_path: Path, certs: Path):
    port = free_port()
    proc = spawn_redis(port, tmp_path / "redis", "--port", "0", "--tls-port", str(port),
                       "--tls-cert-file", str(certs / "redis.crt"), "--tls-key-file", str(certs / "redis.key"),
                       "--tls-ca-cert-file", str(certs / "ca.crt"), "--tls-auth-clients", "no",
                       "--requirepass", PASSWORD)
    return port, proc


def make_certs(where: Path, *names: str) -> Path:
    if shutil.which("openssl") is None:
        pytest.fail("openssl is not installed")
    subprocess.run(["bash", str(SCRIPT), str(where), *names], check=True, capture_output=True, text=True)
    return where


def config(port: int, certs: Path, tmp_path: Path) -> StoreConfig:
    return StoreConfig(backend="redis", redis_url=f"rediss://127.0.0.1:{port}/0", redis_password=PASSWORD,
                       tls=True, tls_ca_file=str(certs / "ca.crt"), stream=f"tls-test-{port}",
                       spill_dir=str(tmp_path / "spill"))


def test_capture_goes_through_tls_with_host_name_checking(tmp_path):
    certs = make_certs(tmp_path / "certs")  # the script's defaults: localhost, 127.0.0.1, this host
    port, proc = tls_redis(tmp_path, certs)
    try:
        cfg = config(port, certs, tmp_path)
        assert cfg.tls_verify  # the server's certificate and its host name are checked
        records = [make_record(i) for i in range(5)]
        stats = write_records(cfg, records)
        assert stats.written == 5
        reader = StoreReader(cfg, group="tls-test", consumer="c0")
        try:
            got = reader.read(10, block_ms=1000)
        finally:
            reader.close()
        assert sorted(d.record.request_id for d in got) == sorted(r.request_id for r in records)
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_certificate_that_does_not_name_the_host_is_refused(tmp_path):
    certs = make_certs(tmp_path / "certs", "some-other-host.example")
    port, proc = tls_redis(tmp_path, certs)
    try:
        backend = open_backend(config(port, certs, tmp_path))
        with pytest.raises(Exception, match="(?i)hostname|certificate|match"):
            backend.ping()
        backend.close()
    finally:
        proc.terminate()
        proc.wait(10)
