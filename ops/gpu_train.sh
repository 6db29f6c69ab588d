#!/usr/bin/env bash
# The GPU training window, prepared: pack here, a few device calls, install the returned head.
# Full sequence (ops/GPU_TRAINING.md says the same in prose):
#
#   here (once, minutes):   bash ops/gpu_train.sh wheels      # pydantic & co. + gguf for the device's Python
#                           bash ops/gpu_train.sh pack        # .gpu/: parts, manifest.json, plan.json
#                           bash ops/gpu_train.sh plan        # prints the device calls below, sized for today's tree
#   window:                 bash ops/gpu_train.sh hide        # heads/ (57 MiB) and docs/results/ out of the checkout: they would travel
#                                                             # with every call and leave ~5 MiB per call for parts
#     device call 1..n-1:   run(command="bash ops/gpu_train.sh device --minutes 6",
#                               carry=[".gpu/manifest.json", ".gpu/part-000.bin"], timeout_s=120)
#                           -> "parts received; make the next call now": call again AT ONCE (the machine
#                              goes back 30 s after a call, and its parts with it)
#     device call n:        run(command=same, carry=[".gpu/manifest.json", ".gpu/part-001.bin"], timeout_s=560)
#                           -> trains 6 minutes on CUDA in bf16, exports to $OUT every 2 minutes and at the end
#                           bash ops/gpu_train.sh restore     # heads/ and docs/results/ back (install does it too)
#   after:                  bash ops/gpu_train.sh install <files_at of the last call>
#                           # joins the head, scores it and the shipped head with eval-head's evaluation on this
#                           # CPU, writes heads/<version>/ only when it is better (head.json records the run)
#
# Every call's command is the same: the device side trains as soon as it holds every part.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
STASH=${GPU_STASH:-${XDG_CACHE_HOME:-$HOME/.cache}/adaptive-eagle/gpu-stash}
VPY=${VPY:-.venv/bin/python}
WORK=${GPU_WORK:-/tmp/gpu_train}
cmd=${1:-help}; shift || true

case "$cmd" in
  wheels)  # what the device's Python lacks, for CPython 3.12 x86-64, one version each
    "$VPY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .gpu/wheels pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5 \
      typing_extensions==4.16.0 gguf==0.19.0 && ls -la .gpu/wheels ;;
  pack)
    "$VPY" -m ops.gpu_train.pack "$@" ;;
  plan)
    "$VPY" - <<'PY'
import json; plan = json.load(open(".gpu/plan.json"))
print(f"{len(plan['calls'])} device calls, payload {plan['payload_mib']} MiB, training {plan['minutes']} min")
for c in plan["calls"]:
    print(json.dumps({"command": c["command"], "carry": c["carry"], "timeout_s": c["timeout_s"]}), f"# {c['carried_mib']} MiB")
PY
    ;;
  hide)  # heads/ and the kept results (docs/results/): neither is needed on the device
    if [ -d "$STASH/heads" ]; then echo "heads/ already hidden in $STASH"; exit 0; fi
    mkdir -p "$STASH" && mv heads "$STASH/heads" && echo "heads/ moved to $STASH/heads; 'bash ops/gpu_train.sh restore' brings it back"
    if [ -d docs/results ] && [ ! -d "$STASH/results" ]; then mv docs/results "$STASH/results" && echo "docs/results/ moved to $STASH/results"; fi ;;
  restore)
    if [ -d "$STASH/results" ] && [ ! -e docs/results ]; then mv "$STASH/results" docs/results && echo "docs/results/ restored"; fi
    if [ ! -d "$STASH/heads" ]; then echo "no heads hidden"; exit 0; fi
    mkdir -p heads
    for d in "$STASH"/heads/*; do [ -e "heads/$(basename "$d")" ] || mv "$d" heads/; done
    rmdir "$STASH/heads" 2>/dev/null || echo "left in $STASH/heads (also present in heads/): $(ls "$STASH/heads")"
    echo "heads/ restored" ;;
  device)  # on the device machine: receive this call's parts; once all are held, train
    PY=${PY:-python3}
    OUT=${OUT:-$WORK/out}; mkdir -p "$OUT" "$WORK"
    export PYTHONUNBUFFERED=1
    "$PY" - <<'PY' || exit 2
import importlib.util, platform, sys
need = ["torch", "transformers", "safetensors", "numpy", "pyarrow", "tqdm", "yaml", "requests"]
missing = [n for n in need if importlib.util.find_spec(n) is None]
print(f"python {platform.python_version()} at {sys.executable}; tree {sys.argv}")
if missing:
    sys.exit(f"the device's Python lacks {missing}: carry them as wheels (see /work/.library/device/README.md)")
PY
    "$PY" -m pip list 2>/dev/null | grep -i -E '^(torch|transformers|safetensors|numpy|pyarrow|tokenizers|pydantic|gguf|typing.extensions) ' || true
    echo "working tree here: $(du -sh --exclude=.gpu . 2>/dev/null | cut -f1)"
    PYTHONPATH="$REPO" "$PY" -m ops.gpu_train.train_gpu receive --sources .gpu --work "$WORK"; rc=$?
    if [ $rc = 3 ]; then echo "parts received; make the next call now"; exit 0; fi
    [ $rc = 0 ] || exit $rc
    if [ ! -f "$WORK/site/.done" ]; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
        "$WORK"/payload/wheels/*.whl && touch "$WORK/site/.done" || { echo "wheel install failed"; exit 2; }
    fi
    "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 2
    PYTHONPATH="$WORK/site:$REPO" "$PY" -m ops.gpu_train.train_gpu train --work "$WORK" --out "$OUT" "$@" 2>&1 \
      | tee "$OUT/train_gpu.log" ;;
  install)  # here, after the window: join, compare on this CPU, install only when better
    bash "$0" restore
    "$VPY" -m ops.gpu_train.install "$@" ;;
  *)
    sed -n '2,27p' "$0" ;;
esac
