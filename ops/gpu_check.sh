#!/usr/bin/env bash
# SGLang check, ready for any machine with an NVIDIA GPU and `pip install 'adaptive-eagle[sglang]'`:
# serves the shipped head through SGLang's EAGLE-3 and checks greedy equality with SGLang's own
# non-speculative output, then swaps the draft through the weight update (draft selector) and checks
# acceptance holds. Engine checks on CUDA without SGLang: bench/gpu_check.sh.
# Usage (repo root): bash ops/gpu_check.sh      # logs under ${OUT:-/tmp/sglang_check}
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/sglang_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
$PY -c "import sglang; print('sglang', sglang.__version__)" || { echo "sglang is not installed: pip install 'adaptive-eagle[sglang]'"; exit 2; }
timeout 900 $PY ops/sglang_check.py "$@" 2>&1 | tee "$OUT/sglang_check.log"
