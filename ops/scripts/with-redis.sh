#!/usr/bin/env bash
# Run a command with a throwaway redis-server on a free loopback port; stop it afterwards.
# Exports ADAPTIVE_EAGLE_TEST_REDIS_URL for the tests.
set -euo pipefail
dir=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
redis-server --port "$port" --bind 127.0.0.1 --dir "$dir" --save "" --appendonly no --daemonize yes \
  --pidfile "$dir/redis.pid" --logfile "$dir/redis.log"
cleanup() { redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || kill "$(cat "$dir/redis.pid" 2>/dev/null)" 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT
for _ in $(seq 50); do redis-cli -p "$port" ping >/dev/null 2>&1 && break; sleep 0.1; done
export ADAPTIVE_EAGLE_TEST_REDIS_URL="redis://127.0.0.1:$port/0"
export ADAPTIVE_EAGLE_TEST_REDIS_PORT="$port"
"$@"
