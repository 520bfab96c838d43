"""Every environment variable the engine reads, in one place. A leaf module: imports nothing."""

from __future__ import annotations

import os


def kernel_backend() -> str:
    """ENGINE_KERNELS: "auto" (Triton on CUDA, torch references on CPU), "triton" or "torch"."""
    value = os.environ.get("ENGINE_KERNELS", "auto").strip().lower() or "auto"
    if value not in ("auto", "triton", "torch"):
        raise ValueError(f"ENGINE_KERNELS must be auto, triton or torch, got {value!r}")
    return value


def triton_interpret() -> bool:
    """TRITON_INTERPRET=1 runs Triton kernels on CPU tensors through Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def api_key() -> str | None:
    """ENGINE_API_KEY: bearer token the HTTP server requires when --api-key is not given."""
    return os.environ.get("ENGINE_API_KEY") or None
