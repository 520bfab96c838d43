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


def configure_inductor_cache() -> str:
    """Where torch.compile keeps its generated code between runs. TORCHINDUCTOR_CACHE_DIR if set,
    else ENGINE_CACHE_DIR/inductor, else ~/.cache/engine/inductor (inductor's own default lives
    under /tmp, which does not survive a reboot). Set in the environment so that inductor's
    compile workers see it too. Returns the directory."""
    path = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not path:
        path = os.path.join(cache_root(), "inductor")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


def cache_root() -> str:
    """ENGINE_CACHE_DIR, else ~/.cache/engine: where the engine keeps what it can rebuild."""
    return os.environ.get("ENGINE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "engine"
    )


def weight_cache_dir() -> str | None:
    """Where dequantized weights are cached (engine/weight_cache.py): ENGINE_WEIGHT_CACHE_DIR,
    else ENGINE_CACHE_DIR/weights, else ~/.cache/engine/weights. None when ENGINE_WEIGHT_CACHE
    is 0, false, off or no."""
    if os.environ.get("ENGINE_WEIGHT_CACHE", "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    return os.environ.get("ENGINE_WEIGHT_CACHE_DIR") or os.path.join(cache_root(), "weights")
