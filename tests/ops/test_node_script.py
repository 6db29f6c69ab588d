"""ops/scripts/node.sh, the one node script of ops/cluster.yaml and ops/local-cluster.yaml, run the way Ray's
cluster launcher runs it: each line wrapped by Ray's own `_with_interactive` / `_with_environment_variables`
(ray/autoscaler/_private/command_runner.py), in a login shell whose HOME is a temporary directory. Ray, Redis,
`aws` and `adaptive-eagle up` are stand-ins on PATH (real processes whose argv looks like theirs), so the test
runs in seconds; bench/cluster.py runs the real ones through `ray up`."""

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private import command_runner  # Ray's own SSH command wrapping

REPO = Path(__file__).resolve().parents[2]
OPS = REPO / "ops"
NODE_SH = OPS / "scripts" / "node.sh"
NODE_IP = "127.0.0.9"  # nothing on this machine runs with this --node-ip-address


def ray_wrapped(cmd: str, env_vars: dict | None = None) -> list[str]:
    """What runs on the node for one command Ray's SSHCommandRunner.run sends (login shells, the default): ssh
    joins the words after user@host with spaces and sshd hands that string to the user's shell as `-c STRING`."""
    if env_vars:
        cmd = command_runner._with_environment_variables(cmd, env_vars)
    return ["bash", "-c", " ".join(command_runner._with_interactive(cmd))]


def sleeper(*argv: str) -> subprocess.Popen:
    """A long-running process whose argv contains `argv` (a stand-in for a program of that name)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", *argv], start_new_session=True)


STUB_SLEEP = f"{sys.executable} -c 'import time; time.sleep(600)'"
STUBS = {
    # `ray start` leaves a process that carries the node's address, as raylet and gcs_server do
    "venv/bin/ray": f"""echo "ray $*" >> "$HOME/calls.log"
# ~/ray-start-fails: how many starts fail as Ray's does when its raylet does not register in time
if [ "$1" = start ] && [ -s "$HOME/ray-start-fails" ] && [ "$(cat "$HOME/ray-start-fails")" -gt 0 ]; then
  echo $(( $(cat "$HOME/ray-start-fails") - 1 )) > "$HOME/ray-start-fails"
  nohup {STUB_SLEEP} raylet-half-started --node_ip_address=127.0.0.9 >/dev/null 2>&1 &
  echo "Exception: The current node timed out during startup." >&2; exit 1
fi
for a in "$@"; do case "$a" in --node-ip-address=*) ip=${{a#*=}};; esac; done
nohup {STUB_SLEEP} raylet-stand-in --node_ip_address=$ip >/dev/null 2>&1 &
nohup {STUB_SLEEP} monitor-stand-in >/dev/null 2>&1 &  # as monitor.py: no node address, the session's""",
    "venv/bin/adaptive-eagle": f"""echo "adaptive-eagle $*" >> "$HOME/calls.log"
[ "$1 $2" = "up --check" ] && exit 0
exec {STUB_SLEEP} adaptive-eagle "$@" """,
    "bin/redis-server": f"""echo "redis-server $*" >> "$HOME/calls.log"
while [ $# -gt 0 ]; do [ "$1" = --pidfile ] && pidfile=$2; shift; done
nohup {STUB_SLEEP} redis-server-stand-in >/dev/null 2>&1 & echo $! > "$pidfile" """,
    "bin/aws": 'echo "aws $*" >> "$HOME/calls.log"; echo secret-from-ssm',
}


@pytest.fixture
def node_home(tmp_path):
    """HOME of a node: the repository at ~/adaptive-eagle (as file_mounts puts it), stand-ins for ray, redis-server,
    aws and adaptive-eagle, ~/.bashrc putting them first on PATH (as `node.sh setup` does for the venv), and a
    stack config whose paths lie in the temporary directory."""
    (tmp_path / "adaptive-eagle").symlink_to(REPO)
    for rel, body in STUBS.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/usr/bin/env bash\n" + body + "\n")
        path.chmod(0o755)
    (tmp_path / "venv" / "bin" / "python").symlink_to(sys.executable)
    (tmp_path / ".bashrc").write_text(f'export PATH="{tmp_path}/bin:{tmp_path}/venv/bin:$PATH"\n')
    stack = yaml.safe_load((OPS / "prod.yaml").read_text())
    stack["state_dir"] = str(tmp_path / "efs" / "state")
    (tmp_path / "stack.yaml").write_text(yaml.safe_dump(stack))
    yield tmp_path
    run_line(tmp_path, f"bash {NODE_SH} stop --venv {tmp_path}/venv --node-ip {NODE_IP}")


def run_line(home: Path, line: str, env_vars: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {"HOME": str(home), "PATH": os.environ["PATH"], "SSH_CONNECTION": f"127.0.0.1 50000 {NODE_IP} 22",
           "TERM": "dumb"}
    return subprocess.run(ray_wrapped(line, env_vars), env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def cluster_line(home: Path, key: str) -> str:
    """The one line of ops/cluster.yaml's `key`, with the venv and the stack config of this test's node."""
    (line,) = yaml.safe_load((OPS / "cluster.yaml").read_text())[key]
    line = line.replace("--venv ~/ae-venv", f"--venv {home}/venv")
    return line.replace("~/adaptive-eagle/ops/prod.yaml", str(home / "stack.yaml"))


def state(home: Path) -> Path:
    return home / ".adaptive-eagle" / f"node-{NODE_IP}"


def wait_exit(proc: subprocess.Popen, timeout: float = 10) -> int | None:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def test_the_old_pkill_line_kills_its_own_shell_under_rays_wrapping(tmp_path):
    """Issue 33 item 1, the old ops/cluster.yaml head start: `pkill -TERM -f 'adaptive-eagle up --config' || true`
    matches the `bash --login -c -i '... && (CMD)'` Ray wraps it in, so the command dies of SIGTERM (143) and
    Ray aborts with "Start command failed.". The pattern here is the old one narrowed to this test's own stand-in
    (a unique config path), so it cannot touch anything else on the machine; it still matches its own shell."""
    (tmp_path / ".bashrc").write_text("")
    pattern = f"adaptive-eagle up --config {tmp_path}/prod.yaml"
    standin = sleeper(*pattern.split())
    try:
        old_line = f"pkill -TERM -f '{pattern}' || true"
        done = subprocess.run(ray_wrapped(old_line), env={"HOME": str(tmp_path), "PATH": os.environ["PATH"]},
                              capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        assert done.returncode == 128 + signal.SIGTERM, (done.returncode, done.stderr)
    finally:
        standin.kill()
        standin.wait()


def test_head_start_under_rays_wrapping_replaces_a_running_up_and_spares_a_stale_pidfiles_program(node_home):
    st = state(node_home)
    st.mkdir(parents=True)
    old_up = sleeper("adaptive-eagle", "up", "--config", "ops/prod.yaml")
    other = sleeper("some-other-program")  # a stale pidfile whose pid was reused by another program
    (st / "up.pid").write_text(f"{old_up.pid}\n")
    (st / "redis.pid").write_text(f"{other.pid}\n")
    try:
        line = cluster_line(node_home, "head_start_ray_commands")
        done = run_line(node_home, line, {"RAY_USAGE_STATS_ENABLED": 0})  # what updater.py adds on the head
        assert done.returncode == 0, done.stdout + done.stderr
        assert wait_exit(old_up) == -signal.SIGTERM  # SIGTERMed by pid, and gone before the new one started
        assert other.poll() is None, "a pidfile whose pid is another program must not be signalled"
        new_pid = int((st / "up.pid").read_text())
        cmdline = Path(f"/proc/{new_pid}/cmdline").read_bytes().split(b"\0")
        assert b"adaptive-eagle" in cmdline and b"up" in cmdline and new_pid != old_up.pid
        calls = (node_home / "calls.log").read_text()
        assert f"ray start --head --node-ip-address={NODE_IP} --port=6379" in calls
        assert "--object-manager-port=8076 --dashboard-host=0.0.0.0" in calls
        assert "up --check --config" in calls and "aws ssm get-parameter --name /adaptive-eagle/redis-password" in calls
        assert "secret-from-ssm" not in calls  # the Redis password is never on a command line
        assert "requirepass" in (st / "redis-auth.conf").read_text()

        again = run_line(node_home, line, {"RAY_USAGE_STATS_ENABLED": 0})  # a second `ray up`
        assert again.returncode == 0, again.stdout + again.stderr
        newer = int((st / "up.pid").read_text())
        assert newer != new_pid and not Path(f"/proc/{new_pid}").exists() or _zombie(new_pid)
    finally:
        for p in (old_up, other):
            p.kill()
            p.wait()


def _zombie(pid: int) -> bool:
    try:
        return "Z" in Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0]
    except (FileNotFoundError, IndexError):
        return True


def test_restart_up_replaces_only_the_stack_and_leaves_ray_and_redis_running(node_home):
    """ops/RUNBOOK.md GatewayDown: on-call restarts `adaptive-eagle up` alone; the head's Ray (and with it the
    cluster) and Redis keep running. With no Ray on the node it refuses and says to use head-start."""
    st = state(node_home)
    line = cluster_line(node_home, "head_start_ray_commands")
    assert run_line(node_home, line).returncode == 0
    up, redis = int((st / "up.pid").read_text()), int((st / "redis.pid").read_text())
    calls_before = (node_home / "calls.log").read_text().count("ray start")
    restart = (f"bash ~/adaptive-eagle/ops/scripts/node.sh restart-up --venv {node_home}/venv "
               f"--config {node_home}/stack.yaml --secrets ssm")
    try:
        done = run_line(node_home, restart)
        assert done.returncode == 0, done.stdout + done.stderr
        new_up = int((st / "up.pid").read_text())
        assert new_up != up and (not Path(f"/proc/{up}").exists() or _zombie(up))
        assert Path(f"/proc/{redis}").exists() and not _zombie(redis)  # Redis kept running
        assert (node_home / "calls.log").read_text().count("ray start") == calls_before  # Ray was not restarted
    finally:
        run_line(node_home, f"bash ~/adaptive-eagle/ops/scripts/node.sh stop --venv {node_home}/venv")
    refused = run_line(node_home, restart)
    assert refused.returncode != 0 and "head-start" in refused.stderr


def test_node_stop_ends_only_this_nodes_processes(node_home):
    """`node.sh stop` (and a node's start) ends the processes of its own --node-ip-address, never another node's
    on the same machine (`ray stop` would end both)."""
    mine = sleeper("raylet", f"--node_ip_address={NODE_IP}")
    neighbour = sleeper("raylet", f"--node_ip_address={NODE_IP}0")  # 127.0.0.90: a prefix is not a match
    try:
        done = run_line(node_home, f"bash ~/adaptive-eagle/ops/scripts/node.sh stop --venv {node_home}/venv")
        assert done.returncode == 0, done.stdout + done.stderr
        assert wait_exit(mine) == -signal.SIGTERM and neighbour.poll() is None
    finally:
        for p in (mine, neighbour):
            p.kill()
            p.wait()


def test_a_worker_start_that_times_out_is_retried_and_a_third_failure_is_an_error(node_home):
    """Ray's autoscaler leaves a node whose start command failed "update-failed" for good (a cluster run here lost
    its second worker so under load): node.sh retries `ray start`, its half-started session stopped first."""
    line = cluster_line(node_home, "worker_start_ray_commands").replace("worker-start", "worker-start --start-retry-s 0")
    (node_home / "ray-start-fails").write_text("1")
    done = run_line(node_home, f"export RAY_HEAD_IP=127.0.0.8; {line}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "attempt 1 of 3" in done.stdout and "worker started" in done.stdout
    assert (node_home / "calls.log").read_text().count("ray start --address=127.0.0.8:6379") == 2
    run_line(node_home, f"bash ~/adaptive-eagle/ops/scripts/node.sh stop --venv {node_home}/venv")
    (node_home / "ray-start-fails").write_text("3")
    failed = run_line(node_home, f"export RAY_HEAD_IP=127.0.0.8; {line}", timeout=120)
    assert failed.returncode != 0 and "failed 3 times" in failed.stderr


def test_worker_start_uses_the_head_address_ray_exports_and_this_nodes_own_address(node_home):
    line = cluster_line(node_home, "worker_start_ray_commands")
    done = run_line(node_home, f"export RAY_HEAD_IP=127.0.0.8; {line}")  # util.py with_head_node_ip's prefix
    assert done.returncode == 0, done.stdout + done.stderr
    calls = (node_home / "calls.log").read_text()
    assert f"ray start --address=127.0.0.8:6379 --node-ip-address={NODE_IP} --object-manager-port=8076" in calls
    sid = (state(node_home) / "ray.sid").read_text().strip()
    session = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _session(p) == sid]
    assert any(b"monitor-stand-in" in (p / "cmdline").read_bytes() for p in session)
    stop = run_line(node_home, f"bash ~/adaptive-eagle/ops/scripts/node.sh stop --venv {node_home}/venv")
    assert stop.returncode == 0, stop.stdout + stop.stderr
    time.sleep(0.5)
    left = [p for p in session if p.exists() and not _zombie(int(p.name))]
    assert not left and not (state(node_home) / "ray.sid").exists()  # everything `ray start` started is gone


def _session(proc: Path) -> str | None:
    try:
        return proc.joinpath("stat").read_text().rsplit(") ", 1)[1].split()[3]
    except (OSError, IndexError):
        return None


def test_a_placeholder_efs_id_is_refused_with_what_to_set(node_home):
    """Issue 33 item 6: Ray forwards no operator environment (`${AE_EFS_ID:-fs-REPLACE-ME}` always expanded to
    its default); the id is a value in the file, and the placeholder stops setup with what to set."""
    (line,) = yaml.safe_load((OPS / "cluster.yaml").read_text())["setup_commands"]
    assert "AE_EFS_ID" not in (OPS / "cluster.yaml").read_text() and "--efs fs-REPLACE-ME" in line
    script = f"NODE_SH_SOURCED=1 . {shlex.quote(str(NODE_SH))}; EFS=fs-REPLACE-ME; mount_shared"
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "--efs fs-0123456789abcdef0" in done.stderr and "ssm:" in done.stderr
    bad = subprocess.run(["bash", "-c", script.replace("fs-REPLACE-ME", "my-efs")], capture_output=True, text=True)
    assert bad.returncode == 2 and "not an EFS file system id" in bad.stderr


def test_sglang_nodes_get_python_dev_headers_and_the_head_installs_boto3_into_its_ray_venv():
    """Issue 33 items 2 and 3: Triton JIT-compiles its launcher against Python.h, so every node that runs SGLang
    installs python3.X-dev; the AWS provider imports boto3 in the Python whose `ray start --head` runs it."""
    cluster = yaml.safe_load((OPS / "cluster.yaml").read_text())
    (worker,) = cluster["worker_setup_commands"]
    assert "--sglang" in worker and "sglang" in worker.split("--extras ")[1].split()[0]

    def packages(flags: str) -> list[str]:
        script = f"NODE_SH_SOURCED=1 . {shlex.quote(str(NODE_SH))}; {flags}; python_packages"
        return subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.split()

    assert "python3.11-dev" in packages("SGLANG=1") and "python3.11-dev" not in packages("SGLANG=0")
    (head_setup,) = cluster["head_setup_commands"]
    (head_start,) = cluster["head_start_ray_commands"]
    venv = lambda line: line.split("--venv ")[1].split()[0]  # noqa: E731
    assert "head-setup" in head_setup and venv(head_setup) == venv(head_start)  # boto3 goes where ray runs
    text = NODE_SH.read_text()
    body = text.split("cmd_head_setup() {")[1].split("\n}\n")[0]
    assert '"$VENV/bin/python" -m pip install -q "$BOTO3_SPEC"' in body and "import boto3" in body
    assert "BOTO3_SPEC='boto3>=1.34,<2'" in text
    start = text.split("cmd_head_start() {")[1].split("\n}\n")[0]
    assert "ray_start --head" in start and '"$VENV/bin/ray" start "$@"' in text  # the same $VENV


def test_provision_puts_target_and_seed_head_at_the_configs_paths_once_when_two_nodes_run_it(tmp_path):
    """Issue 33 item 6: head setup copies the target (as `target-info` materialises it) and the seed head to the
    paths the stack config names; two runs at once (two nodes on one disk) leave one whole copy of each."""
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    built = tmp_path / "cache" / "smollm2-135m"
    built.mkdir(parents=True)
    (built / "config.json").write_text("{}")
    (built / "model.safetensors").write_bytes(os.urandom(1 << 20))
    # the venv's python: the real one, with materialize_builtin answering the stand-in's directory
    (venv / "python").write_text(f"""#!/usr/bin/env bash
if [ "$1" = -c ] && [[ $2 == *materialize_builtin* ]]; then sleep 0.5; echo {built}; exit 0; fi
exec {sys.executable} "$@"
""")
    (venv / "python").chmod(0o755)
    stack = yaml.safe_load((OPS / "prod.yaml").read_text())
    efs = tmp_path / "efs"
    stack["serving"]["target"] = str(efs / "models" / "SmolLM2-135M-Instruct")
    stack["registry"]["seed_head"] = str(efs / "adaptive-eagle" / "heads" / "smollm2-135m-english-v2")
    stack["state_dir"] = str(efs / "adaptive-eagle" / "state")
    stack["store"]["tls_ca_file"] = str(efs / "adaptive-eagle" / "redis-ca.crt")
    (tmp_path / "stack.yaml").write_text(yaml.safe_dump(stack))
    (tmp_path / "redis-tls").mkdir()
    (tmp_path / "redis-tls" / "ca.crt").write_text("CA")
    cmd = ["bash", str(NODE_SH), "provision", "--venv", str(tmp_path / "venv"), "--config", str(tmp_path / "stack.yaml"),
           "--node-ip", NODE_IP]
    env = {**os.environ, "HOME": str(tmp_path)}
    runs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=60)[0] for p in runs]
    assert [p.returncode for p in runs] == [0, 0], outs
    target = Path(stack["serving"]["target"])
    assert (target / "model.safetensors").read_bytes() == (built / "model.safetensors").read_bytes()
    seed = Path(stack["registry"]["seed_head"])
    shipped = REPO / "heads" / "smollm2-135m-english-v2"
    assert sorted(p.name for p in seed.iterdir()) == sorted(p.name for p in shipped.iterdir())
    assert (seed / "model.safetensors").read_bytes() == (shipped / "model.safetensors").read_bytes()
    assert " ".join(outs).count("copied") == 2  # each copied once, the other run found it there
    assert not list(target.parent.glob("*.tmp-*")) and not list(seed.parent.glob("*.tmp-*"))
    assert Path(stack["store"]["tls_ca_file"]).read_text() == "CA"


def test_prod_check_finds_the_provisioned_paths():
    """The paths head setup provisions are the ones `adaptive-eagle up --check --config ops/prod.yaml` reads."""
    stack = yaml.safe_load((OPS / "prod.yaml").read_text())
    (line,) = yaml.safe_load((OPS / "cluster.yaml").read_text())["head_setup_commands"]
    assert "--config ~/adaptive-eagle/ops/prod.yaml" in line
    assert stack["serving"]["target"] == stack["serving"]["sglang"]["model_path"]
    assert Path(stack["registry"]["seed_head"]).name in {p.name for p in (REPO / "heads").iterdir()}


def test_node_setup_run_at_once_on_every_local_node_builds_one_venv_and_one_path_line(tmp_path):
    """Every node on one disk runs `node.sh setup` at the same moment (the local cluster's head and two workers
    share ~aenode): one flock for the whole step, every step checks before it acts, so there is one venv and one PATH
    line. The package install is skipped by its stamp (the real one runs in bench/cluster.py); apt is answered by
    a dpkg-query stand-in saying the Python packages are installed."""
    import hashlib

    venv = tmp_path / "ae-venv"
    venv.mkdir()
    digest = hashlib.sha1((REPO / "pyproject.toml").read_bytes() + b"serve,store \n").hexdigest()[:12]
    (venv / f".ae-installed-{digest}").touch()
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "dpkg-query").write_text("#!/usr/bin/env bash\necho -n 'install ok installed'\n")
    (stubs / "dpkg-query").chmod(0o755)
    env = {**os.environ, "HOME": str(tmp_path), "PATH": f"{stubs}:{os.environ['PATH']}"}
    cmd = ["bash", str(NODE_SH), "setup", "--venv", str(venv), "--extras", "serve,store", "--node-ip", NODE_IP]
    local = yaml.safe_load((OPS / "local-cluster.yaml").read_text())
    nodes = 1 + len(local["provider"]["worker_ips"])
    runs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for _ in range(nodes)]
    outs = [p.communicate(timeout=120)[0] for p in runs]
    assert nodes == 3 and [p.returncode for p in runs] == [0] * nodes, outs
    assert all("setup done" in o for o in outs)
    done = subprocess.run([str(venv / "bin" / "python"), "-c", "import sys; print(sys.prefix)"], capture_output=True,
                          text=True, check=True)
    assert Path(done.stdout.strip()) == venv
    assert (tmp_path / ".bashrc").read_text().count(f'export PATH="{venv}/bin:$PATH"') == 1
