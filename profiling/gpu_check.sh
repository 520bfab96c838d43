#!/usr/bin/env bash
# One go on a lent GPU: every Triton launcher on CUDA against its torch reference (odd shapes,
# fp32/fp16/bf16, and each timed case), then timings against copy/matmul ceilings measured in the
# same run. Writes profiling/results/kernels.md (tables) and profiling/results/kernels.json.
#
#   bash profiling/gpu_check.sh            # full table, a few minutes on an H200
#   bash profiling/gpu_check.sh --quick    # fewer sizes, shorter timing
#
# Works on a fresh machine: creates (or reuses) .venv, seeing the system's packages so that a GPU
# image's CUDA torch and triton are used; installs torch and triton only if they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET  # compiled kernels, not the interpreter
VENV=${VENV:-.venv}
RESULTS=profiling/results

cuda_ok() { "$1" -c 'import sys, torch, triton; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv --system-site-packages "$VENV"
fi
PY=$VENV/bin/python
if ! "$PY" -c 'import torch, triton' 2>/dev/null; then
    "$PY" -m pip install -q torch triton
fi
if ! cuda_ok "$PY"; then
    # e.g. a reused .venv holding a CPU-only torch: fall back to the system python if it has CUDA.
    if command -v python3 >/dev/null && cuda_ok python3; then
        echo "note: $VENV's torch sees no GPU; using $(command -v python3)" >&2
        PY=python3
    else
        echo "error: no torch with CUDA found ($VENV or python3); nothing was run" >&2
        exit 2
    fi
fi
# The engine package (only engine.kernels is imported; kernels.py also puts the repo on sys.path).
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
