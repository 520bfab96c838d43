#!/usr/bin/env bash
# One go on a lent GPU: every Triton launcher on CUDA against its torch reference (odd shapes,
# fp32/fp16/bf16, and each timed case), then timings against copy/matmul ceilings measured in the
# same run. Writes profiling/results/kernels.md (tables) and profiling/results/kernels.json.
#
#   bash profiling/gpu_check.sh            # full table, a few minutes on an H200
#   bash profiling/gpu_check.sh --quick    # fewer sizes, shorter timing
#
# Works on a fresh machine: reuses .venv or a system python3 with CUDA torch, else creates .venv
# and installs torch and triton there.
set -euo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET  # compiled kernels, not the interpreter
VENV=${VENV:-.venv}
RESULTS=profiling/results

cuda_ok() { "$1" -c 'import sys, torch, triton; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }

# 1. a .venv whose torch sees the GPU; 2. a system python3 that has one (a GPU image: no venv is
# made, since a venv made from a venv's python would not see that venv's packages); 3. else make
# .venv and pip install torch and triton into it (needs a package index).
if [ -x "$VENV/bin/python" ] && cuda_ok "$VENV/bin/python"; then
    PY=$VENV/bin/python
elif command -v python3 >/dev/null && cuda_ok python3; then
    PY=$(command -v python3)
else
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    PY=$VENV/bin/python
    "$PY" -c 'import torch, triton' 2>/dev/null || "$PY" -m pip install -q torch triton
    if ! cuda_ok "$PY"; then
        echo "error: no torch with CUDA found ($VENV or python3); nothing was run" >&2
        exit 2
    fi
fi
echo "python: $PY ($("$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'))"
# The engine package (only engine.kernels is imported): installed editable, else on PYTHONPATH.
"$PY" -c 'import engine.kernels' 2>/dev/null \
    || "$PY" -m pip install -q --no-deps --no-build-isolation -e . 2>/dev/null \
    || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import pynvml' 2>/dev/null || "$PY" -m pip install -q nvidia-ml-py 2>/dev/null || true

mkdir -p "$RESULTS"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,clocks.mem,driver_version \
    --format=csv 2>/dev/null | tee "$RESULTS/nvidia-smi.txt" || true
status=0
PYTHONUNBUFFERED=1 "$PY" profiling/kernels.py --json "$RESULTS/kernels.json" \
    --md "$RESULTS/kernels.md" "$@" 2>&1 | tee "$RESULTS/kernels.log" || status=$?
# Where the caller collects files from $OUT (a lent machine's output folder), leave a copy there.
if [ -n "${OUT:-}" ] && [ -d "${OUT}" ]; then
    cp "$RESULTS"/kernels.md "$RESULTS"/kernels.json "$RESULTS"/kernels.log "$OUT"/ 2>/dev/null || true
fi
exit "$status"
