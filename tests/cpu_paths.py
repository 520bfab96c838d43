"""The CPU-path tests a second time, under ENGINE_CPU_ISA=avx2, in a process of their own: what
``make test`` runs after the suite, so that a machine with AVX-512 also checks what an AVX2-only
CPU runs (torch and oneDNN capped to AVX2, the C kernels built for x86-64-v3, bf16 weights
unpacked). On a CPU whose level is avx2 already (or below, or not x86-64) the first pass was
that one, and this one is skipped, saying so.

    .venv/bin/python tests/cpu_paths.py [PYTEST ARGS...]

PATHS is the one list of those tests: the kernels (the C ones and the torch references; not the
Triton-interpreted ones, whose numerics do not follow the CPU class), the layers (bf16 and int8
against float32, the C decoder layers against the torch layers, float32 included: the default
dtype there, whose decode steps the C layers serve with the AVX2 float32 row dots; the tiny
models of each architecture against transformers) and the bf16 cluster. Not the SmolLM2
parity tests (float32 against transformers, ~45 s): the tiny models run the same layers. And
the engine's determinism (batch invariance of the C layers as the engine drives them:
tests/kernels holds the GEMM's and the attention's own).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PATHS = (
    # the C kernels and the torch references (not the Triton-interpreted kernels, whose numerics
    # are the interpreter's whatever the CPU class)
    "tests/kernels/test_attention_rows.py",
    "tests/kernels/test_decode_attention.py",
    "tests/kernels/test_float_matmul.py",
    "tests/kernels/test_gemm.py",
    "tests/kernels/test_gemm_q8.py",
    "tests/kernels/test_int8_matmul.py",
    "tests/kernels/test_kv_quant.py",
    "tests/kernels/test_native.py",
    "tests/kernels/test_native_steal.py",
    "tests/kernels/test_native_structs.py",
    "tests/kernels/test_prefill_attention.py",
    "tests/layers/test_low_precision.py",
    "tests/layers/test_quant.py",
    "tests/layers/test_native_decode.py",
    "tests/model/test_models_vs_transformers.py",
    "tests/cluster/test_cluster_bf16.py",
    "tests/core/test_determinism.py",
)
CAP = "avx2"
# What engine/cpu_isa.py sets for a cap; the caller's own values must not reach the capped run.
TORCH_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def main(argv: list[str]) -> int:
    env = {k: v for k, v in os.environ.items() if k not in TORCH_CAPS}  # before engine sets them
    env["ENGINE_CPU_ISA"] = CAP
    sys.path.insert(0, str(REPO))
    from engine.cpu_isa import LEVELS, this_cpu

    isa = this_cpu()
    if LEVELS.index(isa.hardware_level) <= LEVELS.index(CAP):
        print(
            f"== CPU-path tests under ENGINE_CPU_ISA={CAP}: skipped, this CPU ({isa.model}, "
            f"level {isa.hardware_level}) has nothing above {CAP}: the suite ran as it would"
        )
        return 0
    print(
        f"== CPU-path tests again under ENGINE_CPU_ISA={CAP} (this CPU: {isa.model}, level "
        f"{isa.hardware_level}): {' '.join(PATHS)}",
        flush=True,
    )
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "not slow", *PATHS, *argv]
    code = subprocess.call(cmd, cwd=REPO, env=env)
    print(f"== the ENGINE_CPU_ISA={CAP} pass took {time.monotonic() - t0:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
