"""`ray up` for real on one machine: ops/local-cluster.yaml (Ray's local provider, a head node at 127.0.0.2 and
a worker node at 127.0.0.3, reached over SSH), the same node script (ops/scripts/node.sh) as ops/cluster.yaml,
then traffic through the gateway, the worker node lost and brought back mid-traffic, and `ray down`.

What runs (all real): Debian's sshd on the two loopback addresses (its own config, host key and pid file under
WORK), a node user `aenode` (passwordless sudo, as `ubuntu` on the cloud image) with a generated key, `ray up -y`
(which runs the setup and start commands of the file over SSH on the head; the head's autoscaler does the same
on the worker), Redis with TLS and AUTH on the head, `adaptive-eagle up --config ops/local.yaml` on the head
(gateway, trainer, policy: ae_head), one reference replica on the worker (ae_replica). The node user is not
root, so the `ray stop` of `ray down` ends this cluster's Ray processes and nobody else's on the machine.

Phases: up (`ray up` returns: `ray_up_s`; the first answered request: `ready_s`); traffic (`--clients` threads,
the official `openai` client with a timeout and no client retries, against the gateway); node loss (the worker
node's own Ray processes stopped by `node.sh stop` over SSH, mid-traffic); node back (by default Ray's own
autoscaler restarts Ray on a node without heartbeat, through the cluster file's worker start command;
`--restart bench` runs that command itself after `--down-s`; `node_loss_recovered_s`: from the loss to the
first answer to a request sent after it); traffic after; `ray down -y`, then nothing of the run may be left
(no raylet, gcs_server, adaptive-eagle up, redis-server or any other process of the node user within
`--down-wait-s`: `ray_down_clean`).

A request is failed when it ends with an error (a 5xx or a refused connection: clean, counted by kind), hung when
it reaches the client's timeout. In flight on the lost node = started before the loss, failed after it.
Prints a table and ends with one JSON line. `--quick` (about 10 minutes, less when the node venv exists) is the
short version; the full run is not part of `make test`. Run as root on a machine where nothing else listens on
127.0.0.2:8000 / :6379 / :6380 or 127.0.0.3:22.
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


def summarize(reqs: list[Request], t_loss: float | None, t_restart: float | None = None) -> dict:
    """The run's request figures. In flight on the lost node: started before `t_loss`, failed after it. While
    down: failed, started after the loss and before the first answer to a request started after it (or after
    `t_restart`, when the bench restarted the node itself). `node_loss_recovered_s`: from the loss to that answer."""
    failed = [r for r in reqs if not r.ok]
    since = t_restart if t_restart is not None else t_loss
    answers = sorted(r.end for r in reqs if r.ok and since is not None and r.start >= since)
    back = answers[0] if answers else None
    in_flight = [r for r in failed if t_loss is not None and r.start < t_loss <= r.end]
    down = [r for r in failed if t_loss is not None and r.start >= t_loss and (back is None or r.start < back)]
    other = [r for r in failed if r not in in_flight and r not in down]
    kinds: dict[str, int] = {}
    for r in failed:
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    ok = sorted(r.end - r.start for r in reqs if r.ok)
    return {
        "requests": len(reqs), "ok_requests": len(reqs) - len(failed), "failed_requests": len(failed),
        "hung_requests": sum(r.kind == "hung" for r in reqs),
        "failed_in_flight_on_lost_node": len(in_flight), "failed_while_node_down": len(down),
        "failed_other": len(other), "failed_by_kind": dict(sorted(kinds.items())),
        "node_loss_recovered_s": round(back - t_loss, 2) if back is not None and t_loss is not None else None,
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
print("PLACEMENT " + json.dumps(sorted([a["ActorClassName"], a["Address"]["IPAddress"]] for a in alive)))
"""


def placement(head: str) -> dict:
    """Where Ray placed the stack's actors (class -> node addresses), read from the GCS's actor table on the head.
    The gateway and the policy run in `adaptive-eagle up` itself, on the head node."""
    script = PLACEMENT.format(head=head)
    done = ssh(head, f"RAY_TMPDIR=/tmp/ae-local ~/ae-venv/bin/python -c {shlex.quote(script)}", check=False, timeout=120)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("PLACEMENT ")), None)
    if line is None:
        return {"error": (done.stdout + done.stderr)[-300:]}
    where: dict[str, list[str]] = {}
    for cls, ip in json.loads(line.split(" ", 1)[1]):
        where.setdefault(cls, []).append(ip)
    return where


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


def run(a: argparse.Namespace) -> dict:
    cluster = yaml.safe_load(CLUSTER.read_text())
    head, worker = cluster["provider"]["head_ip"], cluster["provider"]["worker_ips"][0]
    stack = yaml.safe_load((REPO / "ops" / "local.yaml").read_text())
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "ray.log"
    sshd = prepare_host(cluster)
    figures: dict = {"cpu": cpu_name(), "clients": a.clients, "max_tokens": a.max_tokens, "quick": a.quick,
                     "restart": a.restart}
    traffic, t_loss, t_back = None, None, None
    try:
        print(f"ray up -y {CLUSTER.relative_to(REPO)} (log {log})", flush=True)
        figures["ray_up_s"] = round(ray_cmd("up", "-y", "--no-config-cache", "--disable-usage-stats",
                                            str(CLUSTER), log=log, timeout=a.ready_timeout_s), 1)
        print(f"ray up: {figures['ray_up_s']} s", flush=True)
        key = dict(line.split("=", 1) for line in (WORK / "secrets.env").read_text().split())["AE_API_KEY"]
        base = f"http://{stack['serving']['host']}:{stack['serving']['port']}/v1"
        traffic = Traffic(base, key, a.clients, a.max_tokens, a.request_timeout_s)
        figures["ready_s"] = round(wait_ready(traffic, a.ready_timeout_s), 1)
        print(f"first answer {figures['ready_s']} s after ray up returned; traffic from {a.clients} clients",
              flush=True)
        figures["placement"] = placement(head)
        print(f"placement: {figures['placement']}", flush=True)
        for t in traffic.threads:
            t.start()
        time.sleep(a.before_s)
        t_loss = time.monotonic()
        stop = ssh(worker, "bash ~/adaptive-eagle/ops/scripts/node.sh stop --venv ~/ae-venv")
        figures["node_stop_s"] = round(time.monotonic() - t_loss, 1)
        print(f"worker node {worker}: its Ray processes stopped ({figures['node_stop_s']} s)\n{stop.stdout[-600:]}",
              flush=True)
        if a.restart == "bench":  # the node's start command from the cluster file, as Ray's updater runs it
            time.sleep(a.down_s)
            (start_line,) = cluster["worker_start_ray_commands"]
            t_back = time.monotonic()
            back = ssh(worker, f"export RAY_HEAD_IP={head}; {start_line}")  # util.py with_head_node_ip's prefix
            print(f"worker node started again ({time.monotonic() - t_back:.1f} s)\n{back.stdout[-300:]}", flush=True)
        else:  # Ray's autoscaler restarts it (autoscaler.py: "No recent heartbeat, restarting Ray to recover")
            print("waiting for Ray's autoscaler to start the worker node again", flush=True)
        deadline = time.monotonic() + a.ready_timeout_s
        while traffic.first_ok_after(t_back if t_back is not None else t_loss) is None and time.monotonic() < deadline:
            time.sleep(1.0)
        print(f"answered again {time.monotonic() - t_loss:.1f} s after the loss", flush=True)
        figures["placement_after_recovery"] = placement(head)
        time.sleep(a.after_s)
    finally:
        if traffic is not None:
            traffic.stop.set()
            for t in traffic.threads:
                if t.is_alive():
                    t.join(a.request_timeout_s + 5)
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
        sshd.terminate()
        sshd.wait(10)
    if traffic is not None:
        figures.update(summarize(traffic.records, t_loss, t_back))
    return figures


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
    print("\nbench/cluster.py: ray up on ops/local-cluster.yaml, traffic, worker node lost and back, ray down")
    print(table({k: v for k, v in figures.items() if k != "left_running"}))
    if figures["left_running"]:
        print("left running after ray down:\n  " + "\n  ".join(figures["left_running"]))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
