"""bench/chaos.py on real processes: a TLS redis-server that refuses writes (OOM, READONLY), accepts them again
and keeps every acknowledged XADD across a restart; the `for:` scaling of alert rules; a real Prometheus that
scrapes a tiny /metrics server of the test's own and sees a one-rule alert fire."""

from __future__ import annotations

import os
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import redis
import yaml

from bench.chaos import (EVERYSEC_LOSS_S, ChaosError, Prometheus, RedisTLS, parse_duration, promtool_check,
                         scale_duration, scale_rules, write_scaled_rules)

pytestmark = pytest.mark.slow  # real redis-servers and Prometheus under injected faults (the rehearsal's tools)

ALERTS = Path(__file__).resolve().parents[2] / "ops" / "alerts.yml"
DEADLINE_S = 20.0  # generous: a verdict never depends on how fast this machine is


def require_prometheus() -> None:
    """Prometheus and promtool, which `make test` installs: a test that needs them fails without them."""
    if shutil.which("prometheus") is None or shutil.which("promtool") is None:
        pytest.fail("prometheus is not installed: `make prometheus` installs it (apt-get install -y prometheus)",
                    pytrace=False)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# --- RedisTLS -----------------------------------------------------------------------------------------------

@pytest.fixture
def store():
    with RedisTLS() as r:
        yield r
    assert r.pid is None


def refused(client: redis.Redis, error: type[Exception], text: str) -> None:
    with pytest.raises(error, match=text):
        client.xadd("s", {"refused": "1"})


@pytest.mark.redis
def test_tls_client_checks_the_host_and_needs_the_password(store):
    assert store.url.startswith("rediss://localhost:")
    client = store.client()
    assert client.connection_pool.connection_kwargs["ssl_check_hostname"] is True
    assert client.xadd("s", {"a": "1"}) and store.xlen("s") == 1
    with pytest.raises(redis.exceptions.AuthenticationError):
        store.client(password="wrong").ping()


@pytest.mark.redis
def test_oom_refuses_writes_until_accept_writes(store):
    client = store.client()
    first = client.xadd("s", {"i": "0"}).decode()
    store.refuse_writes("oom")
    assert store.refusing == "oom" and client.ping()  # it answers; only writes fail
    # Redis answers "OOM command not allowed ..."; redis-py maps the OOM code to OutOfMemoryError (a ResponseError)
    assert issubclass(redis.exceptions.OutOfMemoryError, redis.exceptions.ResponseError)
    refused(client, redis.exceptions.OutOfMemoryError, "command not allowed when used memory > 'maxmemory'")
    store.accept_writes()
    second = client.xadd("s", {"i": "1"}).decode()
    assert store.stream_ids("s") == {first, second}
    assert int(client.config_get("maxmemory")["maxmemory"]) == 0  # no limit, as before


@pytest.mark.redis
def test_readonly_refuses_writes_and_keeps_the_data(store):
    client = store.client()
    before = {client.xadd("s", {"i": str(i)}).decode() for i in range(50)}
    store.refuse_writes("readonly")
    refused(client, redis.exceptions.ReadOnlyError, "read only replica")
    time.sleep(2.5)  # the replica retries its (refusing) master every second: no sync, no flush of its data
    assert client.info("replication")["master_link_status"] == "down"
    refused(client, redis.exceptions.ReadOnlyError, "read only replica")
    assert store.stream_ids("s") == before
    store.accept_writes()
    assert client.info("replication")["role"] == "master"
    after = client.xadd("s", {"i": "after"}).decode()
    assert store.stream_ids("s") == before | {after}


@pytest.mark.redis
def test_restart_keeps_every_acknowledged_xadd(store):
    client = store.client()
    acked = {client.xadd("s", {"i": str(i)}).decode() for i in range(200)}
    store.refuse_writes("readonly")
    port, pid = store.port, store.pid
    store.restart(0.5)
    assert store.port == port and store.pid != pid and gone(pid)
    assert store.refusing is None  # a restarted server accepts writes again
    assert store.stream_ids("s") == acked and store.xlen("s") == 200
    acked.add(client.xadd("s", {"i": "after"}).decode())  # the old client reconnects
    assert store.stream_ids("s") == acked


@pytest.mark.redis
@pytest.mark.parametrize("appendfsync", ["always", "everysec"])
def test_a_sigkill_mid_write_keeps_what_the_persistence_promises(appendfsync):
    """SIGKILL while a second client keeps writing: no shutdown, no last fsync. Every XADD acknowledged before
    the kill is back after the restart (everysec: Redis write()s to its file before it replies, so only a write it
    postponed behind a slow fsync, in the last EVERYSEC_LOSS_S, may be lost; always: none)."""
    with RedisTLS(appendfsync=appendfsync) as store:
        client, writer = store.client(), store.client(socket_timeout=2)
        acked: list[str] = []
        stop = threading.Event()

        def write() -> None:
            i = 0
            while not stop.is_set():
                try:
                    acked.append(writer.xadd("s", {"i": str(i)}).decode())
                except redis.exceptions.RedisError:
                    pass  # the server is gone: unacknowledged, so not counted
                i += 1

        t = threading.Thread(target=write, daemon=True)
        t.start()
        while len(acked) < 300:
            time.sleep(0.01)
        pid, killed_ms = store.pid, int(time.time() * 1000)
        store.restart(0.2, kill=True)
        stop.set()
        t.join(10)
        assert gone(pid)
        lost = set(acked) - store.stream_ids("s")
        window_ms = 1000 * EVERYSEC_LOSS_S if appendfsync == "everysec" else 0
        assert all(killed_ms - int(i.split("-")[0]) <= window_ms for i in lost), (appendfsync, sorted(lost)[:5])
        assert client.xadd("s", {"i": "after"})


def test_the_store_refuses_a_persistence_it_does_not_model():
    with pytest.raises(ChaosError, match="appendfsync"):
        RedisTLS(appendfsync="no")


@pytest.mark.redis
def test_a_failed_block_leaves_no_redis_server_behind():
    with pytest.raises(RuntimeError, match="boom"):
        with RedisTLS() as r:
            pid, workdir = r.pid, r.dir
            raise RuntimeError("boom")
    assert gone(pid) and not workdir.exists()


# --- for: scaling (pure) ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, factor, want", [
    ("5m", 0.05, "15s"), ("1h30m", 0.05, "4m30s"), ("1h30m", 1.0, "1h30m"), ("30s", 0.01, "1s"),
    ("1h", 0.5, "30m"), ("2m", 0.001, "1s"), ("0s", 0.5, "0s"), ("10m", 2, "20m"),
])
def test_scale_duration(text, factor, want):
    assert scale_duration(text, factor) == want


def test_parse_duration_and_its_refusals():
    assert parse_duration("1h30m") == 5400 and parse_duration("1d") == 86400 and parse_duration("0") == 0
    assert parse_duration("1m500ms") == 60.5
    for bad in ("", "5", "m5", "5 m", "1.5m", "30m1h"):
        with pytest.raises(ValueError, match="not a Prometheus duration"):
            parse_duration(bad)
    with pytest.raises(ValueError, match="for_scale"):
        scale_duration("5m", 0)


def test_scale_rules_touches_only_alert_for_durations():
    doc = {"groups": [{"name": "g", "interval": "30s", "rules": [
        {"alert": "A", "expr": "up == 0", "for": "10m", "labels": {"severity": "page"}},
        {"alert": "B", "expr": "up == 0"},
        {"record": "r", "expr": "sum(up)"}]}]}
    out = scale_rules(doc, 0.1)
    assert out["groups"][0]["rules"][0] == {**doc["groups"][0]["rules"][0], "for": "1m"}
    assert out["groups"][0]["rules"][1:] == doc["groups"][0]["rules"][1:] and out["groups"][0]["interval"] == "30s"
    assert doc["groups"][0]["rules"][0]["for"] == "10m"  # the input is not changed


def test_scaled_ops_alerts_keeps_every_rule(tmp_path):
    out = write_scaled_rules(ALERTS, tmp_path / "rules.yml", 0.05)
    src, got = yaml.safe_load(ALERTS.read_text()), yaml.safe_load(out.read_text())
    pairs = [(a, b) for ga, gb in zip(src["groups"], got["groups"]) for a, b in zip(ga["rules"], gb["rules"])]
    assert len(pairs) == sum(len(g["rules"]) for g in src["groups"]) > 10
    for a, b in pairs:
        assert {k: v for k, v in a.items() if k != "for"} == {k: v for k, v in b.items() if k != "for"}
        if "for" in a:
            assert parse_duration(b["for"]) == max(1, round(parse_duration(a["for"]) * 0.05))


# --- Prometheus ---------------------------------------------------------------------------------------------

TOKEN = "chaos-test-token"


class Gauge(BaseHTTPRequestHandler):
    """/metrics with one gauge at 1, for a scraper that sends `Authorization: Bearer TOKEN`."""

    def do_GET(self):  # noqa: N802 - http.server's name
        body = b"# TYPE chaos_test_gauge gauge\nchaos_test_gauge 1\n"
        authorized = self.headers.get("Authorization") == f"Bearer {TOKEN}"
        self.send_response(401 if not authorized else 200 if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def metrics_target():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Gauge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def one_rule(tmp_path: Path, expr: str = "chaos_test_gauge > 0", for_: str = "20s") -> Path:
    path = tmp_path / "alerts.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "t", "rules": [
        {"alert": "ChaosGaugeUp", "expr": expr, "for": for_, "labels": {"severity": "page"}}]}]}))
    return path


def test_prometheus_sees_the_alert_fire(tmp_path, metrics_target):
    require_prometheus()
    with Prometheus(metrics_target, one_rule(tmp_path), for_scale=0.05, bearer_token=TOKEN) as prom:  # 20s -> 1s
        assert yaml.safe_load((prom.dir / "rules.yml").read_text())["groups"][0]["rules"][0]["for"] == "1s"
        prom.watch(every_s=0.5)
        deadline = time.monotonic() + DEADLINE_S
        while "ChaosGaugeUp" not in prom.firing() and time.monotonic() < deadline:
            time.sleep(0.25)
        assert prom.firing() == {"ChaosGaugeUp"}
        assert prom.pid is not None
        pid = prom.pid
        deadline = time.monotonic() + 5
        while "ChaosGaugeUp" not in prom.fired and time.monotonic() < deadline:
            time.sleep(0.1)
        assert prom.pending["ChaosGaugeUp"] <= prom.fired["ChaosGaugeUp"] <= time.time()
        assert prom.poll_errors == 0
    assert gone(pid) and prom.pid is None


def test_ops_alerts_scaled_pass_promtool_and_a_bad_rule_is_refused(tmp_path, metrics_target):
    require_prometheus()
    bad = one_rule(tmp_path, expr="sum(chaos_test_gauge")
    with pytest.raises(ChaosError, match="promtool check rules"):
        Prometheus(metrics_target, bad, workdir=tmp_path / "bad").start()
    promtool_check("rules", write_scaled_rules(ALERTS, tmp_path / "ops.yml", 0.01))  # raises on a fault


def test_a_missing_prometheus_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH
    prom = Prometheus("127.0.0.1:9", one_rule(tmp_path))
    with pytest.raises(ChaosError, match="make prometheus"):
        prom.start()
    assert not prom.dir.exists()


def test_an_alert_counts_for_a_fault_when_it_fires_anew_or_its_value_rises(tmp_path):
    prom = Prometheus("127.0.0.1:1", one_rule(tmp_path), workdir=tmp_path / "p")  # not started: history by hand
    prom._history = [(10.0, {}), (20.0, {"Restarted": 1.0}), (30.0, {"Restarted": 1.2}), (40.0, {"Restarted": 2.0}),
                     (50.0, {"Down": 1.0, "Restarted": 2.0})]
    assert prom.alerted_between("Restarted", 15.0, 25.0) == 20.0  # was not firing before: fires anew
    assert prom.alerted_between("Restarted", 25.0, 35.0) is None  # still firing for the earlier event (drift 0.2)
    assert prom.alerted_between("Restarted", 35.0, 45.0) == 40.0  # its value rose: a second event
    assert prom.alerted_between("Down", 45.0, 60.0) == 50.0 and prom.alerted_between("Down", 0.0, 40.0) is None
