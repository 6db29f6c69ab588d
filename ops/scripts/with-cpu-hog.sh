#!/usr/bin/env bash
# Run a command the way a shared CI machine meets it: one busy-loop process per core (at normal
# priority, as another CPU-heavy job would be) for the whole run, and an empty adaptive-eagle cache
# (no compute-mode table, no acceptance calibrations, no dequantised target: all measured or rebuilt
# under load, as on a fresh machine). The hogs and the cache are removed afterwards.
#   HOGS=n        busy processes (default: the cores this process may use)
#   KEEP_CACHE=1  keep the user's cache instead (the load alone)
set -euo pipefail
hogs=${HOGS:-$(nproc)}
pids=()
cache=""
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait "${pids[@]}" 2>/dev/null || true
  [ -n "$cache" ] && rm -rf "$cache"
  return 0
}
trap cleanup EXIT
if [ "${KEEP_CACHE:-0}" != 1 ]; then
  cache=$(mktemp -d)
  export ADAPTIVE_EAGLE_CACHE="$cache"
fi
for _ in $(seq "$hogs"); do
  bash -c 'while :; do :; done' &
  pids+=($!)
done
echo "with-cpu-hog: $hogs busy processes (pids ${pids[*]}); cache ${ADAPTIVE_EAGLE_CACHE:-$HOME/.cache/adaptive-eagle}" >&2
status=0
"$@" || status=$?
exit "$status"
