"""Chaos services for a production rehearsal (bench/rehearsal.py): real processes to break and to watch.

Owns: a real redis-server with TLS and AUTH on loopback that can be restarted, made to refuse writes and
made to accept them again (`RedisTLS`); a real Prometheus server that scrapes one /metrics endpoint and
evaluates ops/alerts.yml with its `for:` durations scaled down, and a poller that records when each alert
first went pending and firing (`Prometheus`); the pure `for:` scaling (`parse_duration`, `scale_duration`,
`scale_rules`). Every process it starts is stopped by `stop()`, on leaving a `with` block, on a failed start
and at interpreter exit; none is left behind (a SIGKILLed Python process is the one case it cannot cover).
Must not touch: the loop itself (serving, feature_store, trainer, policies), what a rehearsal does with
these services, and any redis-server or Prometheus it did not start.

Vocabulary: *refusing* writes means the server answers but rejects them (`OOM command not allowed`,
`READONLY`), as a full or failed-over Redis does; *down* means nothing answers on the port.
"""

from __future__ import annotations

import atexit
import json
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

REPO = Path(__file__).resolve().parents[1]
CERT_SCRIPT = REPO / "ops" / "scripts" / "redis-tls-cert.sh"
START_TIMEOUT_S = 60.0  # a start on a loaded 2-core machine is slow; only a hang fails it
STOP_TIMEOUT_S = 30.0
# appendfsync everysec: Redis write()s a command to its append-only file before replying, except while a background
# fsync is slow, when it postpones the write for up to 2 s (redis.conf and aof.c); so a SIGKILL can lose at most the
# writes acknowledged in the last EVERYSEC_LOSS_S seconds
EVERYSEC_LOSS_S = 2.0
PROMETHEUS_HINT = "`make prometheus` (or `apt-get install -y prometheus`) installs it (Debian's 2.42, with promtool)"
RefusalKind = Literal["oom", "readonly"]


class ChaosError(RuntimeError):
    """A chaos service could not start, stop or change state; the message says what to do."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def _end_process(proc: Optional[subprocess.Popen], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM, wait up to timeout_s, then SIGKILL; returns when the process is gone."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _fresh_dir(prefix: str) -> Path:
    """A new path under the temp dir, not created yet (a service makes it when it starts)."""
    return Path(tempfile.gettempdir()) / f"{prefix}{secrets.token_hex(6)}"


def _need_binary(name: str, how_to_install: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise ChaosError(f"{name} is not installed: {how_to_install}")
    return path


# --- Redis -------------------------------------------------------------------------------------------------

class RedisTLS:
    """A redis-server on 127.0.0.1 with only a TLS port, a private CA (ops/scripts/redis-tls-cert.sh), AUTH,
    and an append-only file. `appendfsync` is Redis's: "always" fsyncs before every reply; "everysec" (Redis's
    default, and what ops/scripts/node.sh runs in production: `--appendonly yes`) write()s each command to
    the file before replying and fsyncs once a second, so a killed process loses nothing the kernel holds but a
    write Redis postponed behind a slow fsync (up to EVERYSEC_LOSS_S; a machine crash loses up to that too).
    A clean `restart` (SIGTERM) fsyncs on exit either way.

    State changed with CONFIG SET / REPLICAOF (`refuse_writes`) lives in memory only: a restart starts
    accepting writes again, as a real restarted server does."""

    def __init__(self, workdir: Optional[Path] = None, password: Optional[str] = None,
                 appendfsync: Literal["always", "everysec"] = "always") -> None:
        if appendfsync not in ("always", "everysec"):
            raise ChaosError(f"appendfsync must be 'always' or 'everysec', got {appendfsync!r}")
        self.appendfsync = appendfsync
        self._own_dir = workdir is None
        self.dir = Path(workdir) if workdir is not None else _fresh_dir("chaos-redis-")  # made by start()
        self.password = password or secrets.token_urlsafe(24)
        self.port: Optional[int] = None
        self._proc: Optional[subprocess.Popen] = None
        self._admin: Any = None  # redis.Redis, made on first use
        self._refusing: Optional[RefusalKind] = None
        self._saved_memory: dict[str, str] = {}
        self._dead_master: Optional[socket.socket] = None  # bound, never listening: connections are refused
        self._certs: Optional[Path] = None

    # where it is
    @property
    def url(self) -> str:
        if self.port is None:
            raise ChaosError("RedisTLS is not started: call start() (or use it in a with block)")
        return f"rediss://localhost:{self.port}/0"

    @property
    def ca_file(self) -> str:
        return str(self._cert_dir() / "ca.crt")

    @property
    def pid(self) -> Optional[int]:
        """The redis-server's process id while it runs, else None."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def refusing(self) -> Optional[RefusalKind]:
        """The kind of refusal in force ("oom", "readonly"), or None when writes are accepted."""
        return self._refusing

    # life cycle
    def start(self) -> "RedisTLS":
        """Start on a free port (first start) or on the same port (after stop; with the same data only when
        `workdir` was given: stop removes a dir it made); returns once it answers PING over TLS."""
        if self._proc is not None and self._proc.poll() is None:
            return self
        atexit.register(self.stop)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if self.port is not None:
                self._spawn(self.port)
            else:
                self._start_on_a_free_port()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGTERM (Redis fsyncs its append-only file and exits); SIGKILL after 30 s. Removes its dir when
        it made it. Safe to call twice."""
        atexit.unregister(self.stop)
        self._release_dead_master()
        self._close_admin()
        _end_process(self._proc)
        self._proc = None
        self._refusing = None
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self._certs = None

    def restart(self, down_s: float, kill: bool = False) -> None:
        """SIGTERM (or, `kill`, SIGKILL: no shutdown, no last fsync), wait for the exit, stay down `down_s` seconds,
        start again on the same port and dir; returns when it answers PING, with what its append-only file kept
        (after a SIGTERM every acknowledged write; after a SIGKILL what `appendfsync` promises)."""
        if self.port is None:
            raise ChaosError("RedisTLS.restart before start(): nothing to restart")
        self._release_dead_master()
        self._close_admin()
        if kill and self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(STOP_TIMEOUT_S)
        _end_process(self._proc)
        self._proc = None
        self._refusing = None
        time.sleep(max(0.0, down_s))
        try:
            self._spawn(self.port)
        except BaseException:
            self.stop()
            raise

    def __enter__(self) -> "RedisTLS":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # faults
    def refuse_writes(self, kind: RefusalKind) -> None:
        """Make every write fail while reads still work: "oom" sets maxmemory below used_memory with
        maxmemory-policy noeviction (`OOM command not allowed ...`); "readonly" makes it a replica of a
        master that refuses connections (a loopback port held bound but never listening), so writes get
        `READONLY You can't write against a read only replica` and, the master never being reached, no
        sync ever replaces its data (tests/bench/test_chaos.py checks it keeps it). redis-py raises
        OutOfMemoryError and ReadOnlyError, both ResponseErrors, with the code word stripped from the text."""
        if kind not in ("oom", "readonly"):
            raise ValueError(f"refuse_writes kind must be 'oom' or 'readonly', not {kind!r}")
        self.accept_writes()
        admin = self._client()
        if kind == "oom":
            self._saved_memory = {k: _text(admin.config_get(k)[k]) for k in ("maxmemory", "maxmemory-policy")}
            used = int(admin.info("memory")["used_memory"])
            admin.config_set("maxmemory-policy", "noeviction")
            admin.config_set("maxmemory", str(max(1, min(used // 2, 1 << 20))))
        else:
            self._dead_master = socket.socket()
            self._dead_master.bind(("127.0.0.1", 0))
            admin.replicaof("127.0.0.1", str(self._dead_master.getsockname()[1]))
        self._refusing = kind

    def accept_writes(self) -> None:
        """Undo `refuse_writes`, whichever kind: maxmemory back to what it was (0: no limit), REPLICAOF NO ONE."""
        if self._refusing == "oom":
            admin = self._client()
            for key, value in self._saved_memory.items():
                admin.config_set(key, value)
        elif self._refusing == "readonly":
            self._client().replicaof("NO", "ONE")
            self._release_dead_master()
        self._refusing = None

    # observation
    def client(self, **kwargs: Any) -> Any:
        """A new redis-py client over TLS: the server's certificate checked against ca_file, its host name
        checked, AUTH with the password. kwargs go to redis.Redis (e.g. socket_timeout)."""
        import redis

        opts: dict[str, Any] = dict(password=self.password, ssl_ca_certs=self.ca_file, ssl_cert_reqs="required",
                                    ssl_check_hostname=True, socket_timeout=5.0, socket_connect_timeout=5.0)
        opts.update(kwargs)
        return redis.Redis.from_url(self.url, **opts)

    def xlen(self, stream: str) -> int:
        return int(self._client().xlen(stream))

    def stream_ids(self, stream: str) -> set[str]:
        """Every entry id in the stream (to check that acknowledged XADDs survived)."""
        ids: set[str] = set()
        start = "-"
        while True:
            batch = self._client().xrange(stream, min=start, max="+", count=10_000)
            for entry_id, _ in batch:
                ids.add(_text(entry_id))
            if len(batch) < 10_000:
                return ids
            start = "(" + _text(batch[-1][0])

    # internals
    def _cert_dir(self) -> Path:
        if self._certs is None:
            if shutil.which("openssl") is None:
                raise ChaosError("openssl is not installed (apt-get install -y openssl): RedisTLS makes its certs with it")
            out = subprocess.run(["bash", str(CERT_SCRIPT), str(self.dir / "certs"), "localhost", "127.0.0.1"],
                                 capture_output=True, text=True)
            if out.returncode != 0:
                raise ChaosError(f"{CERT_SCRIPT} failed ({out.returncode}):\n{out.stdout}{out.stderr}")
            m = re.search(r"redis-tls-cert: (\S+)/redis\.crt for", out.stdout)
            if m is None:
                raise ChaosError(f"{CERT_SCRIPT} did not say where its certificate is:\n{out.stdout}")
            self._certs = Path(m.group(1))
        return self._certs

    def _start_on_a_free_port(self) -> None:
        for attempt in range(3):  # the free port may be taken between free_port() and redis binding it
            try:
                self._spawn(free_port())
                return
            except ChaosError:
                if attempt == 2:
                    raise

    def _spawn(self, port: int) -> None:
        binary = _need_binary("redis-server", "`make redis-server` installs it")
        certs = self._cert_dir()
        data = self.dir / "data"
        data.mkdir(parents=True, exist_ok=True)
        log = self.dir / "redis.log"
        self.port = port
        self._proc = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", "0", "--tls-port", str(port),
             "--tls-cert-file", str(certs / "redis.crt"), "--tls-key-file", str(certs / "redis.key"),
             "--tls-ca-cert-file", str(certs / "ca.crt"), "--tls-auth-clients", "no",
             "--requirepass", self.password, "--appendonly", "yes", "--appendfsync", self.appendfsync,
             "--dir", str(data), "--save", "", "--daemonize", "no", "--logfile", str(log)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self._wait_for_ping(log)

    def _wait_for_ping(self, log: Path) -> None:
        import redis

        deadline = time.monotonic() + START_TIMEOUT_S
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                self._proc = None
                raise ChaosError(f"redis-server exited ({code}) on start, port {self.port}:\n{_log_tail(log)}")
            try:
                if self._client().ping():
                    return
            except redis.exceptions.BusyLoadingError as e:  # replaying the append-only file
                last = e
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
                last = e
                self._close_admin()
            time.sleep(0.05)
        _end_process(self._proc)
        self._proc = None
        raise ChaosError(f"redis-server on port {self.port} did not answer PING in {START_TIMEOUT_S:.0f} s "
                         f"(last error: {last}):\n{_log_tail(log)}")

    def _client(self) -> Any:
        if self._admin is None:
            self._admin = self.client(socket_timeout=2.0, socket_connect_timeout=2.0)
        return self._admin

    def _close_admin(self) -> None:
        if self._admin is not None:
            self._admin.close()
            self._admin = None

    def _release_dead_master(self) -> None:
        if self._dead_master is not None:
            self._dead_master.close()
            self._dead_master = None


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# --- alert rules: `for:` scaling (pure) --------------------------------------------------------------------

_UNITS = {"y": 365 * 86400.0, "w": 7 * 86400.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_DURATION = re.compile(r"^(?:(\d+)y)?(?:(\d+)w)?(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?(?:(\d+)ms)?$")


def _alert_value(alert: dict) -> float:
    """An alert's value from /api/v1/alerts ("1e+00"); NaN when it has none."""
    try:
        return float(alert.get("value", "nan"))
    except (TypeError, ValueError):
        return float("nan")


def parse_duration(text: str) -> float:
    """Seconds in a Prometheus duration ("5m", "30s", "1h30m", "0"); ValueError when it is not one."""
    text = str(text).strip()
    m = _DURATION.match(text)
    if text == "0":
        return 0.0
    if not text or m is None:
        raise ValueError(f"{text!r} is not a Prometheus duration (like 30s, 5m, 1h30m)")
    return sum(int(v) * _UNITS[u] for v, u in zip(m.groups(), ("y", "w", "d", "h", "m", "s", "ms")) if v)


def format_duration(seconds: int) -> str:
    """Whole seconds as a Prometheus duration, largest units first: 270 -> "4m30s", 0 -> "0s"."""
    if seconds <= 0:
        return "0s"
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return "".join(f"{v}{u}" for v, u in ((h, "h"), (m, "m"), (s, "s")) if v)


def scale_duration(text: str, factor: float) -> str:
    """`text` times `factor`, rounded to whole seconds, at least 1 s ("5m" * 0.05 -> "15s", "30s" * 0.01 ->
    "1s"). A zero duration stays "0s" (an alert with no wait keeps none)."""
    if factor <= 0:
        raise ValueError(f"for_scale must be > 0, not {factor}")
    seconds = parse_duration(text)
    if seconds == 0:
        return "0s"
    return format_duration(max(1, round(seconds * factor)))


def scale_rules(rules: dict, factor: float) -> dict:
    """A copy of a Prometheus rules document with every alerting rule's `for:` scaled (scale_duration);
    recording rules and everything else unchanged."""
    groups = []
    for group in rules.get("groups") or []:
        new_rules = []
        for rule in group.get("rules") or []:
            rule = dict(rule)
            if "alert" in rule and "for" in rule:
                rule["for"] = scale_duration(rule["for"], factor)
            new_rules.append(rule)
        groups.append({**group, "rules": new_rules})
    return {**rules, "groups": groups}


def write_scaled_rules(source: Path, dest: Path, factor: float) -> Path:
    """Read a rules file (yaml.safe_load), scale its `for:` durations, write it to dest."""
    doc = yaml.safe_load(Path(source).read_text())
    if not isinstance(doc, dict) or "groups" not in doc:
        raise ChaosError(f"{source} is not a Prometheus rules file (no top-level 'groups')")
    dest.write_text(yaml.safe_dump(scale_rules(doc, factor), sort_keys=False, width=1000))
    return dest


def promtool_check(what: Literal["rules", "config"], path: Path) -> None:
    """`promtool check rules|config PATH`; ChaosError with promtool's output when it finds a fault."""
    promtool = _need_binary("promtool", PROMETHEUS_HINT)
    out = subprocess.run([promtool, "check", what, str(path)], capture_output=True, text=True)
    if out.returncode != 0:
        source = "the rules file" if what == "rules" else "the scrape target or the rules"
        raise ChaosError(f"promtool check {what} {path} failed ({out.returncode}); fix {source}:\n"
                         f"{out.stdout}{out.stderr}")


# --- Prometheus --------------------------------------------------------------------------------------------

class Prometheus:
    """A Prometheus server on 127.0.0.1 that scrapes `target` (host:port serving /metrics) every
    `scrape_interval_s` (the scrape timeout too) and evaluates `rules_file` every second, each alert's `for:`
    multiplied by `for_scale` (at least 1 s). The
    rules and the config are checked with promtool before it starts. Range windows in the expressions
    (rate(...[5m])) are not scaled."""

    def __init__(self, target: str, rules_file: Path | str, for_scale: float = 1.0,
                 bearer_token: Optional[str] = None, job_name: str = "adaptive-eagle",
                 workdir: Optional[Path] = None, scrape_interval_s: int = 1) -> None:
        if for_scale <= 0:
            raise ValueError(f"for_scale must be > 0, not {for_scale}")
        if not 1 <= scrape_interval_s <= 60:
            raise ValueError(f"scrape_interval_s must be in [1, 60] whole seconds, not {scrape_interval_s}")
        self.scrape_interval_s = int(scrape_interval_s)
        self.target, self.rules_file, self.for_scale = target, Path(rules_file), for_scale
        self.job_name = job_name
        self._bearer_token = bearer_token
        self._own_dir = workdir is None
        self.dir = Path(workdir) if workdir is not None else _fresh_dir("chaos-prometheus-")  # made by start()
        self.port: Optional[int] = None
        self._proc: Optional[subprocess.Popen] = None
        self._lock = threading.Lock()
        self._fired: dict[str, float] = {}
        self._history: list[tuple[float, dict[str, float]]] = []  # (poll time, firing alert -> its largest value)
        self._pending: dict[str, float] = {}
        self._stop_watch = threading.Event()
        self._watcher: Optional[threading.Thread] = None
        self.poll_errors = 0  # failed polls of the watcher (it keeps polling); last_poll_error says why
        self.last_poll_error: Optional[str] = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise ChaosError("Prometheus is not started: call start() (or use it in a with block)")
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> Optional[int]:
        """The prometheus process id while it runs, else None."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def fired(self) -> dict[str, float]:
        """Alert name -> unix time the watcher first saw it firing (a copy)."""
        with self._lock:
            return dict(self._fired)

    @property
    def pending(self) -> dict[str, float]:
        """Alert name -> unix time the watcher first saw it pending or firing (a copy)."""
        with self._lock:
            return dict(self._pending)

    def start(self) -> "Prometheus":
        """Write the scaled rules and prometheus.yml, check both with promtool, start the server and return
        once /-/ready answers 200."""
        if self._proc is not None and self._proc.poll() is None:
            return self
        atexit.register(self.stop)
        try:
            binary = _need_binary("prometheus", PROMETHEUS_HINT)
            config = self._write_config()
            promtool_check("rules", self.dir / "rules.yml")
            promtool_check("config", config)
            self._spawn(binary, config)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the watcher and the server (SIGTERM, SIGKILL after 30 s); remove its dir when it made it."""
        atexit.unregister(self.stop)
        self._stop_watch.set()
        if self._watcher is not None:
            self._watcher.join(10)
            self._watcher = None
        _end_process(self._proc)
        self._proc = None
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Prometheus":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def alerts(self) -> list[dict[str, Any]]:
        """/api/v1/alerts: every pending or firing alert (labels, annotations, state, activeAt, value)."""
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/alerts", timeout=5) as resp:
                body = json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise ChaosError(f"Prometheus at {self.url} did not answer /api/v1/alerts: {e}") from e
        if body.get("status") != "success":
            raise ChaosError(f"Prometheus /api/v1/alerts answered {body}")
        return list(body["data"]["alerts"])

    def firing(self) -> set[str]:
        """Names of the alerts firing now."""
        return {a["labels"]["alertname"] for a in self.alerts() if a.get("state") == "firing"}

    def alerted_between(self, name: str, t0: float, t1: float, min_rise: float = 0.5) -> Optional[float]:
        """The first poll time in [t0, t1] at which alert `name` fired anew: it was not firing at the last poll
        before t0, or its value rose by `min_rise` or more above what it was then (an alert such as
        `increase(x[15m]) > 0`, still firing for an earlier event, counts a new one by its value; increase()
        extrapolates, so its value drifts by fractions between events). None: it did not."""
        with self._lock:
            history = list(self._history)
        before = next((f for t, f in reversed(history) if t < t0), {})
        for t, firing in history:
            if t0 <= t <= t1 and name in firing and (name not in before or firing[name] >= before[name] + min_rise):
                return t
        return None

    def watch(self, every_s: float = 1.0) -> None:
        """Start a poller thread recording the first time each alert is seen pending (`pending`) and firing
        (`fired`). A failed poll is counted (`poll_errors`, `last_poll_error`) and the poller keeps going."""
        if self._watcher is not None:
            return
        self._stop_watch.clear()
        self._watcher = threading.Thread(target=self._watch_loop, args=(every_s,), name="chaos-prometheus-watch",
                                         daemon=True)
        self._watcher.start()

    # internals
    def _watch_loop(self, every_s: float) -> None:
        while not self._stop_watch.is_set():
            try:
                alerts = self.alerts()
            except Exception as e:  # noqa: BLE001 - counted and visible; a rehearsal restarts things under it
                self.poll_errors += 1
                self.last_poll_error = repr(e)
            else:
                now = time.time()
                firing: dict[str, float] = {}
                for a in alerts:
                    if a.get("state") == "firing":
                        name = a["labels"]["alertname"]
                        firing[name] = max(firing.get(name, float("-inf")), _alert_value(a))
                with self._lock:
                    for a in alerts:
                        name = a["labels"]["alertname"]
                        self._pending.setdefault(name, now)
                        if a.get("state") == "firing":
                            self._fired.setdefault(name, now)
                    self._history.append((now, firing))
            self._stop_watch.wait(every_s)

    def _write_config(self) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        rules = write_scaled_rules(self.rules_file, self.dir / "rules.yml", self.for_scale)
        every = f"{self.scrape_interval_s}s"
        job: dict[str, Any] = {"job_name": self.job_name, "scrape_interval": every, "scrape_timeout": every,
                               "static_configs": [{"targets": [self.target]}]}
        if self._bearer_token is not None:
            token_file = self.dir / "bearer_token"
            token_file.touch(mode=0o600)
            token_file.write_text(self._bearer_token)
            job["authorization"] = {"type": "Bearer", "credentials_file": str(token_file)}
        config = {"global": {"scrape_interval": every, "scrape_timeout": every, "evaluation_interval": "1s"},
                  "rule_files": [str(rules)], "scrape_configs": [job]}
        path = self.dir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    def _spawn(self, binary: str, config: Path) -> None:
        log = self.dir / "prometheus.log"
        for attempt in range(3):  # the free port may be taken before prometheus binds it
            self.port = free_port()
            with open(log, "ab") as out:
                self._proc = subprocess.Popen(
                    [binary, f"--config.file={config}", f"--storage.tsdb.path={self.dir / 'data'}",
                     f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
            if self._wait_ready(log, last_try=attempt == 2):
                return

    def _wait_ready(self, log: Path, last_try: bool) -> bool:
        deadline = time.monotonic() + START_TIMEOUT_S
        assert self._proc is not None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                if "address already in use" in _log_tail(log) and not last_try:
                    return False
                raise ChaosError(f"prometheus exited ({self._proc.returncode}) on start:\n{_log_tail(log)}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise ChaosError(f"prometheus at {self.url} was not ready in {START_TIMEOUT_S:.0f} s:\n{_log_tail(log)}")
