"""`ray up` for real on one machine: ops/local-cluster.yaml (Ray's local provider, a head node at 127.0.0.2 and
two worker nodes at 127.0.0.3 and 127.0.0.4, reached over SSH), the same node script (ops/scripts/node.sh) as
ops/cluster.yaml, then traffic through the gateway, one worker node lost and brought back mid-traffic while the
other keeps serving, and `ray down`.

What runs (all real): Debian's sshd on the two loopback addresses (its own config, host key and pid file under
WORK), a node user `aenode` (passwordless sudo, as `ubuntu` on the cloud image) with a generated key, `ray up -y`
(which runs the setup and start commands of the file over SSH on the head; the head's autoscaler does the same
on the worker), Redis with TLS and AUTH on the head, `adaptive-eagle up --config ops/local.yaml` on the head
(gateway, trainer, policy: ae_head), two reference replicas as in ops/prod.yaml, one on each worker (each has
`ae_replica: 1`). The node user is not root, so the `ray stop` of `ray down` ends this cluster's Ray processes
and nobody else's on the machine.

Phases: up (`ray up` returns: `ray_up_s`; the first answered request: `ready_s`; then every replica answers its
status, and where each runs: `replicas`, replica -> node, matched by process id between the gateway's
/admin/status and Ray's actor table); traffic (`--clients` threads, the official `openai` client with a timeout
and no client retries, against the gateway); node loss (the Ray processes of the worker node that hosts
`--lose` (replica-0) stopped by `node.sh stop` over SSH, mid-traffic: `lost_node`; the other replica keeps
serving); node back (by default Ray's own autoscaler restarts Ray on a node without heartbeat, through the
cluster file's worker start command; `--restart bench` runs that command itself after `--down-s`;
`node_loss_recovered_s`: from the loss until the lost replica answers its status from a new process and has
served a request; `first_answer_after_loss_s`: the first answer to a request sent after the loss, from either
replica); traffic after; the gateway's replica failures and restarts read from its /metrics (a replica failure
the client never saw was retried on the other replica); `ray down -y`, then nothing of the run may be left
(no raylet, gcs_server, adaptive-eagle up, redis-server or any other process of the node user within
`--down-wait-s`: `ray_down_clean`).

A request is failed when it ends with an error (a 5xx or a refused connection: clean, counted by kind), hung when
it reaches the client's timeout. In flight on the lost node = started before the loss, failed after it; while
the node was down = started after the loss, before the lost replica served again (with two replicas: 0, the
other replica takes them); `failed_beyond_in_flight` = all failed but those in flight. Prints a table and ends
with one JSON line. `--quick` (about 10 minutes, less when the node venv exists) is the short version; the full
run is not part of `make test`. Run as root on a machine where nothing else listens on 127.0.0.2:8000 / :6379 /
:6380 or 127.0.0.2-4:22.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "ops" / "local-cluster.yaml"
WORK = Path("/var/tmp/adaptive-eagle-local")  # the paths ops/local-cluster.yaml and ops/local.yaml name
NODE_USER = "aenode"
PROMPTS = ["Write one sentence about rivers.", "Name three colours.", "What is 12 times 7?",
           "Give a word that rhymes with light.", "Say hello in French.", "Describe a cat in five words."]


@dataclass(frozen=True)
class Request:
    """One chat completion sent through the gateway."""

    client: int
    start: float     # monotonic seconds
    end: float
    ok: bool
    kind: str        # "ok", "hung" (client timeout), "5xx:<status>", "4xx:<status>", "connection", "other:<type>"


def check_args(a: argparse.Namespace) -> argparse.Namespace:
    """Refuse settings the run cannot work with (every check says what to change)."""
    if a.clients < 1 or a.clients > 16:
        raise SystemExit(f"--clients: 1..16, got {a.clients}")
    for name in ("before_s", "down_s", "after_s", "request_timeout_s", "ready_timeout_s", "down_wait_s"):
        if getattr(a, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')}: must be > 0, got {getattr(a, name)}")
    if a.request_timeout_s <= 60:
        raise SystemExit("--request-timeout-s: must exceed the gateway's serving.request_timeout_s (60 in "
                         f"ops/local.yaml), or a slow answer would count as hung; got {a.request_timeout_s}")
    if not 1 <= a.max_tokens <= 64:
        raise SystemExit(f"--max-tokens: 1..64 (serving.max_tokens_limit in ops/local.yaml), got {a.max_tokens}")
    return a


def summarize(reqs: list[Request], t_loss: float | None, t_restart: float | None = None,
              t_recovered: float | None = None, t_stopped: float | None = None) -> dict:
    """The run's request figures. The loss is the stop's span, from `t_loss` (node.sh stop sent) to `t_stopped`
    (it returned: every process of the node gone; SIGTERM, then SIGKILL for what outlives the wait): until then
    the lost replica still takes requests. In flight on the lost node: failed, started before `t_stopped` and
    ended after `t_loss`. While down: failed, started after the stop and before the node was back: `t_recovered` (the lost replica served
    again, seen by the bench) when given, else the first answer to a request started after the loss (or after
    `t_restart`, when the bench restarted the node itself). `node_loss_recovered_s`: from the loss to then."""
    failed = [r for r in reqs if not r.ok]
    since = t_restart if t_restart is not None else t_loss
    answers = sorted(r.end for r in reqs if r.ok and since is not None and r.start >= since)
    first = min((r.end for r in reqs if r.ok and t_loss is not None and r.start >= t_loss), default=None)
    back = t_recovered if t_recovered is not None else (answers[0] if answers else None)
    gone = t_stopped if t_stopped is not None else t_loss
    in_flight = [r for r in failed if t_loss is not None and r.start < gone and r.end >= t_loss]
    down = [r for r in failed if t_loss is not None and r.start >= gone and (back is None or r.start < back)]
    other = [r for r in failed if r not in in_flight and r not in down]
    kinds: dict[str, int] = {}
    for r in failed:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    ok = sorted(r.end - r.start for r in reqs if r.ok)
    return {
        "requests": len(reqs), "ok_requests": len(reqs) - len(failed), "failed_requests": len(failed),
        "hung_requests": sum(r.kind == "hung" for r in reqs),
        "failed_in_flight_on_lost_node": len(in_flight), "failed_while_node_down": len(down),
        "failed_other": len(other), "failed_beyond_in_flight": len(failed) - len(in_flight),
        "failed_by_kind": dict(sorted(kinds.items())),
        "node_loss_recovered_s": round(back - t_loss, 2) if back is not None and t_loss is not None else None,
        "first_answer_after_loss_s": round(first - t_loss, 2) if first is not None else None,
        "restart_to_recovered_s": round(back - t_restart, 2) if back is not None and t_restart is not None else None,
        "latency_p50_s": round(ok[len(ok) // 2], 3) if ok else None,
        "latency_max_s": round(ok[-1], 3) if ok else None,
    }


def table(summary: dict) -> str:
    rows = [(k, json.dumps(v) if isinstance(v, (dict, list, bool)) or v is None else str(v)) for k, v in summary.items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


# --- the host: sshd, node user, key -------------------------------------------------------------------------
def sh(cmd: list[str] | str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, shell=isinstance(cmd, str), check=check, text=True, capture_output=True, **kw)


def prepare_host(cluster: dict) -> subprocess.Popen:
    """Debian's sshd on the cluster's addresses, the node user with a generated key: what ops/local-cluster.yaml
    expects to find. Returns the sshd process (started here, stopped by the caller)."""
    missing = [p for p in ("openssh-server", "rsync", "sudo")
               if "install ok installed" not in sh(["dpkg-query", "-W", "-f=${Status}", p], check=False).stdout]
    if missing:
        print(f"apt-get install {' '.join(missing)}", flush=True)
        sh("apt-get update -qq")
        sh(["apt-get", "install", "-y", "-qq", *missing], env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    if sh(["id", NODE_USER], check=False).returncode != 0:
        sh(["useradd", "-m", "-s", "/bin/bash", NODE_USER])
    sh(["usermod", "-p", "*", NODE_USER])  # no password, but not locked (sshd refuses a locked account's keys)
    Path(f"/etc/sudoers.d/{NODE_USER}").write_text(f"{NODE_USER} ALL=(ALL) NOPASSWD:ALL\n")
    os.chmod(f"/etc/sudoers.d/{NODE_USER}", 0o440)
    ssh_dir = WORK / "ssh"
    ssh_dir.mkdir(parents=True, exist_ok=True)
    key = Path(cluster["auth"]["ssh_private_key"])
    if not key.exists():
        sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)])
    host_key = ssh_dir / "host_ed25519"
    if not host_key.exists():
        sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)])
    home = Path(f"/home/{NODE_USER}")
    (home / ".ssh").mkdir(mode=0o700, exist_ok=True)
    (home / ".ssh" / "authorized_keys").write_text(Path(f"{key}.pub").read_text())
    sh(["chown", "-R", f"{NODE_USER}:{NODE_USER}", str(home / ".ssh")])
    efs = WORK / "efs"
    efs.mkdir(parents=True, exist_ok=True)
    sh(["chown", f"{NODE_USER}:{NODE_USER}", str(efs)])
    secrets_env = WORK / "secrets.env"  # what SSM holds in prod (--secrets file:... in the cluster file)
    if not secrets_env.exists():
        secrets_env.write_text("".join(f"{k}={secrets.token_hex(16)}\n"
                                       for k in ("AE_REDIS_PASSWORD", "AE_ADMIN_TOKEN", "AE_API_KEY")))
    sh(["chown", f"{NODE_USER}:{NODE_USER}", str(secrets_env)])
    os.chmod(secrets_env, 0o600)
    ips = [cluster["provider"]["head_ip"], *cluster["provider"]["worker_ips"]]
    config = ssh_dir / "sshd_config"
    config.write_text("".join(f"ListenAddress {ip}\n" for ip in ips) + (
        f"Port 22\nHostKey {host_key}\nPidFile {ssh_dir / 'sshd.pid'}\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nPubkeyAuthentication yes\nUsePAM no\nPermitRootLogin no\n"
        f"AllowUsers {NODE_USER}\nMaxStartups 50:30:100\nMaxSessions 50\n"))
    Path("/run/sshd").mkdir(exist_ok=True)
    sshd = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL,
                            stderr=open(ssh_dir / "sshd.log", "w"), start_new_session=True)  # Ctrl-C spares it
    for _ in range(50):
        if ssh(ips[0], "true", check=False).returncode == 0:
            return sshd
        time.sleep(0.2)
    sshd.kill()
    raise SystemExit(f"sshd did not answer on {ips[0]} (see {ssh_dir / 'sshd.log'})")


def ssh(ip: str, command: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `command` on a node the way Ray's SSHCommandRunner does: its login-shell wrapping
    (command_runner._with_interactive), ssh with the cluster's key."""
    from ray.autoscaler._private.command_runner import _with_interactive

    key = yaml.safe_load(CLUSTER.read_text())["auth"]["ssh_private_key"]
    argv = ["ssh", "-i", key, "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
            "-o", "LogLevel=ERROR", "-o", "BatchMode=yes", f"{NODE_USER}@{ip}", *_with_interactive(command)]
    return subprocess.run(argv, check=check, text=True, capture_output=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


PLACEMENT = """
import json, ray
from ray._private import state
ray.init(address="{head}:6379", _node_ip_address="{head}", logging_level="ERROR", log_to_driver=False)
alive = [a for a in state.actors().values() if a["State"] == "ALIVE"]
print("PLACEMENT " + json.dumps(sorted([a["ActorClassName"], a["Address"]["IPAddress"], a["Pid"]] for a in alive)))
"""


@dataclass(frozen=True)
class Placement:
    """Where Ray placed the stack's live actors: class -> node addresses, and replica name -> node address
    (a replica's process id from the gateway's /admin/status found in Ray's actor table: one machine, so a pid
    names one process of one node)."""

    actors: dict[str, list[str]]
    replicas: dict[str, str]


def place(rows: list[list], statuses: list[dict]) -> Placement:
    """`rows`: [class, ip, pid] per live actor (the actor table); `statuses`: /admin/status's replicas."""
    actors: dict[str, list[str]] = {}
    for cls, ip, _ in sorted(rows):
        actors.setdefault(cls, []).append(ip)
    node_of = {pid: ip for _, ip, pid in rows}
    return Placement(actors, {s["replica"]: node_of.get(s.get("pid"), "unknown") for s in sorted(
        statuses, key=lambda s: s["replica"])})


def actor_rows(head: str) -> list[list]:
    """The live actors' [class, node address, pid], read from the GCS's actor table on the head. The gateway and
    the policy run in `adaptive-eagle up` itself, on the head node."""
    script = PLACEMENT.format(head=head)
    done = ssh(head, f"RAY_TMPDIR=/tmp/ae-local ~/ae-venv/bin/python -c {shlex.quote(script)}", check=False, timeout=120)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("PLACEMENT ")), None)
    if line is None:
        raise RuntimeError(f"no actor table from the head: {(done.stdout + done.stderr)[-300:]}")
    return json.loads(line.split(" ", 1)[1])


class Admin:
    """The gateway's /admin/status (the admin token from the secrets file) and /metrics."""

    def __init__(self, base: str, token: str) -> None:
        self.base, self.token = base, token

    def replicas(self) -> list[dict]:
        """The replicas that answer their status now (one whose node is gone is left out)."""
        req = urllib.request.Request(f"{self.base}/admin/status", headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.load(r)["replicas"]

    def counters(self, name: str) -> dict[str, float]:
        """`name{replica="X"} N` lines of /metrics as {X: N} (ae_replica_failures_total, ae_replica_restarts_total)."""
        with urllib.request.urlopen(f"{self.base}/metrics", timeout=30) as r:
            return metric_by_replica(r.read().decode(), name)


def metric_by_replica(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") and 'replica="' in line:
            out[line.split('replica="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


def wait_replicas(admin: Admin, n: int, timeout_s: float) -> list[dict]:
    """Until `n` replicas answer their status (the worker nodes joined, each replica loaded its target)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            answering = admin.replicas()
        except OSError:
            answering = []
        if len(answering) >= n or time.monotonic() > deadline:
            return answering
        time.sleep(2.0)


def replica_back(statuses: list[dict], name: str, old_pid: int | None) -> bool:
    """`name` answers from a new process (Ray restarted its actor on the node that came back) and has served."""
    return any(s["replica"] == name and s.get("pid") != old_pid and s.get("served", 0) >= 1 for s in statuses)


def node_user_processes() -> list[str]:
    """Every process of the node user still running (after `ray down`, nothing may be)."""
    import psutil

    left = []
    for p in psutil.process_iter(["username", "pid", "cmdline"]):
        if p.info["username"] == NODE_USER:
            left.append(f"{p.info['pid']} {' '.join(p.info['cmdline'] or [])[:160]}")
    return left


# --- traffic ------------------------------------------------------------------------------------------------
class Traffic:
    """`clients` threads sending chat completions back to back through the gateway (official openai client)."""

    def __init__(self, base_url: str, api_key: str, clients: int, max_tokens: int, timeout_s: float) -> None:
        import openai

        self.openai, self.records, self.lock = openai, [], threading.Lock()
        self.stop = threading.Event()
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout_s, max_retries=0)
        self.max_tokens = max_tokens
        self.threads = [threading.Thread(target=self.loop, args=(i,), daemon=True) for i in range(clients)]

    def one(self, i: int, n: int) -> Request:
        start = time.monotonic()
        try:
            self.client.chat.completions.create(model="adaptive-eagle", max_tokens=self.max_tokens,
                                                messages=[{"role": "user", "content": PROMPTS[(i + n) % len(PROMPTS)]}])
            kind, ok = "ok", True
        except self.openai.APITimeoutError:
            kind, ok = "hung", False
        except self.openai.APIStatusError as e:
            kind, ok = f"{e.status_code // 100}xx:{e.status_code}", False
        except self.openai.APIConnectionError:
            kind, ok = "connection", False
        except Exception as e:  # noqa: BLE001 - counted, never raised: the run goes on
            kind, ok = f"other:{type(e).__name__}", False
        return Request(i, start, time.monotonic(), ok, kind)

    def loop(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            r = self.one(i, n)
            n += 1
            with self.lock:
                self.records.append(r)
            if not r.ok:
                self.stop.wait(1.0)  # a refused request is retried by the next one, a second later

    def first_ok_after(self, t: float) -> float | None:
        with self.lock:
            ends = [r.end for r in self.records if r.ok and r.start >= t]
        return min(ends) if ends else None


def wait_ready(traffic: Traffic, timeout_s: float) -> float:
    """Seconds until one request is answered (the worker joined, its replica loaded the target and the head)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        r = traffic.one(0, 0)
        if r.ok:
            return time.monotonic() - t0
        time.sleep(2.0)
    raise TimeoutError(f"no answer from the gateway within {timeout_s:g} s")


def ray_cmd(*args: str, log: Path, timeout: float) -> float:
    t0 = time.monotonic()
    with open(log, "a") as f:
        f.write(f"\n$ ray {' '.join(args)}\n")
        f.flush()
        done = subprocess.run([str(Path(sys.executable).parent / "ray"), *args], cwd=REPO, stdout=f,
                              stderr=subprocess.STDOUT, timeout=timeout, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"ray {args[0]} exited {done.returncode} (see {log})")
    return time.monotonic() - t0


def await_recovery(admin: Admin, name: str, old_pid: int | None, timeout_s: float) -> float | None:
    """Until replica `name` serves again from a new process (monotonic time), None after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if replica_back(admin.replicas(), name, old_pid):
                return time.monotonic()
        except OSError:  # the gateway busy or restarting: asked again a second later
            pass
        time.sleep(1.0)
    return None


def lose_node(a: argparse.Namespace, cluster: dict, node: str, figures: dict) -> tuple[float, float, float | None]:
    """Stop `node`'s Ray processes (node.sh stop over SSH); with --restart bench start it again after --down-s.
    Returns (the loss, the stop's end, the bench's restart or None) in monotonic seconds."""
    t_loss, t_restart = time.monotonic(), None
    stop = ssh(node, "bash ~/adaptive-eagle/ops/scripts/node.sh stop --venv ~/ae-venv")
    t_stopped = time.monotonic()
    figures["node_stop_s"] = round(t_stopped - t_loss, 1)
    print(f"worker node {node}: its Ray processes stopped ({figures['node_stop_s']} s)\n{stop.stdout[-600:]}",
          flush=True)
    if a.restart == "bench":  # the node's start command from the cluster file, as Ray's updater runs it
        time.sleep(a.down_s)
        (start_line,) = cluster["worker_start_ray_commands"]
        t_restart = time.monotonic()
        head = cluster["provider"]["head_ip"]
        back = ssh(node, f"export RAY_HEAD_IP={head}; {start_line}")  # util.py with_head_node_ip's prefix
        print(f"worker node started again ({time.monotonic() - t_restart:.1f} s)\n{back.stdout[-300:]}", flush=True)
    else:  # Ray's autoscaler restarts it (autoscaler.py: "No recent heartbeat, restarting Ray to recover")
        print(f"waiting for Ray's autoscaler to start worker node {node} again", flush=True)
    return t_loss, t_stopped, t_restart


def up_and_place(a: argparse.Namespace, head: str, stack: dict, log: Path, figures: dict) -> tuple[Admin, Traffic, list]:
    """`ray up`, the first answer, every replica answering, where each runs (into `figures`)."""
    print(f"ray up -y {CLUSTER.relative_to(REPO)} (log {log})", flush=True)
    figures["ray_up_s"] = round(ray_cmd("up", "-y", "--no-config-cache", "--disable-usage-stats",
                                        str(CLUSTER), log=log, timeout=a.ready_timeout_s), 1)
    print(f"ray up: {figures['ray_up_s']} s", flush=True)
    t_up = time.monotonic()
    secret = dict(line.split("=", 1) for line in (WORK / "secrets.env").read_text().split())
    base = f"http://{stack['serving']['host']}:{stack['serving']['port']}"
    admin = Admin(base, secret["AE_ADMIN_TOKEN"])
    traffic = Traffic(f"{base}/v1", secret["AE_API_KEY"], a.clients, a.max_tokens, a.request_timeout_s)
    figures["ready_s"] = round(wait_ready(traffic, a.ready_timeout_s), 1)
    answering = wait_replicas(admin, stack["serving"]["replicas"], a.ready_timeout_s)
    figures["replicas_ready_s"] = round(time.monotonic() - t_up, 1)
    where = place(actor_rows(head), answering)
    figures["placement"], figures["replicas"] = where.actors, where.replicas
    admin.counters("ae_replica_restarts_total")  # a scrape records each replica's pid: a later new one is a restart
    print(f"first answer {figures['ready_s']} s after ray up returned, {len(answering)} replicas answering after "
          f"{figures['replicas_ready_s']} s; placement {where.actors}; replicas {where.replicas}", flush=True)
    return admin, traffic, answering


def run(a: argparse.Namespace) -> dict:
    cluster = yaml.safe_load(CLUSTER.read_text())
    head, workers = cluster["provider"]["head_ip"], cluster["provider"]["worker_ips"]
    stack = yaml.safe_load((REPO / "ops" / "local.yaml").read_text())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "ray.log"
    sshd = prepare_host(cluster)
    figures: dict = {"cpu": cpu_name(), "clients": a.clients, "max_tokens": a.max_tokens, "quick": a.quick,
                     "restart": a.restart, "workers": workers, "replicas_configured": stack["serving"]["replicas"]}
    admin, traffic, t_loss, t_stopped, t_restart, t_back = None, None, None, None, None, None
    try:
        admin, traffic, answering = up_and_place(a, head, stack, log, figures)
        lost = figures["replicas"].get(a.lose)
        if lost not in workers:
            raise RuntimeError(f"--lose {a.lose}: not on a worker node ({figures['replicas']})")
        figures["lost_replica"], figures["lost_node"] = a.lose, lost
        old_pid = next((s.get("pid") for s in answering if s["replica"] == a.lose), None)
        for t in traffic.threads:
            t.start()
        time.sleep(a.before_s)
        t_loss, t_stopped, t_restart = lose_node(a, cluster, lost, figures)
        t_back = await_recovery(admin, a.lose, old_pid, a.ready_timeout_s)
        print(f"{a.lose} served again {time.monotonic() - t_loss:.1f} s after the loss" if t_back else
              f"{a.lose} did not serve again within {a.ready_timeout_s:g} s", flush=True)
        where = place(actor_rows(head), admin.replicas())
        figures["placement_after_recovery"], figures["replicas_after_recovery"] = where.actors, where.replicas
        time.sleep(a.after_s)
    finally:
        if traffic is not None:
            traffic.stop.set()
            for t in traffic.threads:
                if t.is_alive():
                    t.join(a.request_timeout_s + 5)
        teardown(a, head, admin, out, log, figures)
        sshd.terminate()
        sshd.wait(10)
    if traffic is not None:
        figures.update(summarize(traffic.records, t_loss, t_restart, t_back, t_stopped))
        zero = t_loss if t_loss is not None else 0.0  # each request's times from the loss (to read with the logs)
        (out / "requests.jsonl").write_text("".join(json.dumps({
            "client": r.client, "start_s": round(r.start - zero, 2), "end_s": round(r.end - zero, 2),
            "kind": r.kind}) + "\n" for r in traffic.records))
    return figures


def teardown(a: argparse.Namespace, head: str, admin: Admin | None, out: Path, log: Path, figures: dict) -> None:
    """The gateway's replica counters and the stack's log copied, then `ray down` and nothing left running."""
    try:
        if admin is not None:  # a replica failure no client saw was retried on the other replica
            figures["replica_failures"] = admin.counters("ae_replica_failures_total")
            figures["replica_restarts"] = admin.counters("ae_replica_restarts_total")
    except OSError as e:
        figures["replica_failures"] = f"unread: {e}"
    try:
        (out / "up.log").write_text(ssh(head, f"cat ~/.adaptive-eagle/node-{head}/up.log", check=False).stdout)
    except Exception:  # noqa: BLE001 - a log copy never stops the teardown
        pass
    t0 = time.monotonic()
    try:
        figures["ray_down_s"] = round(ray_cmd("down", "-y", str(CLUSTER), log=log, timeout=600), 1)
    except Exception as e:  # noqa: BLE001 - counted: ray_down_clean says what was left
        figures["ray_down_error"] = str(e)
    left = node_user_processes()
    while left and time.monotonic() - t0 < a.down_wait_s:
        time.sleep(1.0)
        left = node_user_processes()
    figures["ray_down_clean"] = not left and "ray_down_error" not in figures
    figures["left_running"] = left
    for line in left:  # clean up for the next run; counted above
        subprocess.run(["kill", "-9", line.split()[0]], check=False)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the short run (about 10 minutes here)")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--before-s", type=float, default=None, help="traffic before the node loss (quick 45, else 180)")
    ap.add_argument("--restart", choices=("autoscaler", "bench"), default="autoscaler", help="who starts the lost "
                    "node again: Ray's autoscaler (it restarts Ray on a node without heartbeat), or this bench "
                    "after --down-s (the node's start command from the cluster file, over SSH)")
    ap.add_argument("--down-s", type=float, default=20.0, help="with --restart bench: how long the node stays down")
    ap.add_argument("--lose", default="replica-0", help="the replica whose worker node is lost mid-traffic")
    ap.add_argument("--after-s", type=float, default=None, help="traffic after recovery (quick 30, else 120)")
    ap.add_argument("--request-timeout-s", type=float, default=90.0, help="the client's timeout: a request "
                    "that reaches it is hung")
    ap.add_argument("--ready-timeout-s", type=float, default=900.0)
    ap.add_argument("--down-wait-s", type=float, default=60.0, help="how long `ray down` may take to leave nothing")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "cluster"))
    a = ap.parse_args()
    a.before_s = a.before_s or (45.0 if a.quick else 180.0)
    a.after_s = a.after_s or (30.0 if a.quick else 120.0)
    check_args(a)
    if os.geteuid() != 0:
        raise SystemExit("run as root: it installs sshd and the node user")
    if shutil.which("ssh") is None:
        raise SystemExit("needs the ssh client (apt-get install openssh-client)")
    t0 = time.monotonic()
    figures = run(a)
    figures["total_s"] = round(time.monotonic() - t0, 1)
    print("\nbench/cluster.py: ray up on ops/local-cluster.yaml, traffic, one worker node lost and back, ray down")
    print(table({k: v for k, v in figures.items() if k != "left_running"}))
    if figures["left_running"]:
        print("left running after ray down:\n  " + "\n  ".join(figures["left_running"]))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
