"""The whole C library built for another x86-64 level, to check that every path gives the same
bits (integer products: AVX-512 with or without VNNI, AVX2, plain loops)."""

from __future__ import annotations

import ctypes
import platform
import subprocess
from pathlib import Path

import pytest

from engine import cpu_isa
from engine.kernels import native

# what each -march level runs on: a v4 build needs AVX-512 from the CPU itself (not its cap)
_NEEDS = {"x86-64-v4": ("avx512", "avx512bf16", "amx")}


def build_for(march: str, tmp_path: Path) -> ctypes.CDLL:
    """The library built with -march=``march`` and loaded; skips where this machine cannot
    build or run it."""
    from engine.kernels.native import _HERE, FLAGS, SOURCES, load_library

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("these builds target x86-64")
    if march in _NEEDS and cpu_isa.this_cpu().hardware_level not in _NEEDS[march]:
        pytest.skip(f"this CPU cannot run a {march} build")
    lib_path = tmp_path / f"native-{march}.so"
    subprocess.run(
        [native.compiler(), *FLAGS, f"-march={march}", *(str(_HERE / s) for s in SOURCES), "-o",
         str(lib_path), "-lm"],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return load_library(lib_path)
