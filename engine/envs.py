"""Every environment variable the engine reads, in one place. A leaf module: imports nothing."""

from __future__ import annotations

import os


def kernel_backend() -> str:
    """ENGINE_KERNELS: "auto" (Triton on CUDA; on CPU the C kernels where they build, else the
    torch references), "triton", "torch" (the references everywhere) or "native" (the C kernels
    on CPU, an error where they cannot be built)."""
    value = os.environ.get("ENGINE_KERNELS", "auto").strip().lower() or "auto"
    if value not in ("auto", "triton", "torch", "native"):
        raise ValueError(f"ENGINE_KERNELS must be auto, triton, torch or native, got {value!r}")
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


def curve_keys() -> str | None:
    """ENGINE_CURVE_KEYS: a directory made by ``engine keys generate``; when set, every ZeroMQ
    socket of the cluster, the pool service and the RPC server uses CURVE and admits only peers
    whose public key is in it (``--curve-keys DIR`` sets it for the process and its children)."""
    return os.environ.get("ENGINE_CURVE_KEYS") or None


def curve_insecure() -> bool:
    """ENGINE_CURVE_INSECURE=1: allow binding ZeroMQ sockets beyond loopback without CURVE keys
    (any peer that reaches the port is then served)."""
    return os.environ.get("ENGINE_CURVE_INSECURE", "0") not in ("", "0")


def fault_kv() -> str | None:
    """ENGINE_FAULT_KV (tests only): faults injected into KV layer messages a prefill worker
    sends, e.g. "drop=0.05,corrupt=0.05,delay=0.05,delay_s=0.3,seed=1"
    (cluster/transfer/faults.py)."""
    return os.environ.get("ENGINE_FAULT_KV") or None


def test_max_tokens() -> int | None:
    """ENGINE_TEST_MAX_TOKENS (tests only; never set it elsewhere): caps every request's
    max_tokens (and min_tokens) where the engine admits it, whatever the entry point (LLM,
    AsyncLLM, engine serve/rpc, the workers of a cluster), so that the documentation's commands
    run as written in little time (tests/e2e/test_docs.py). None when unset."""
    value = os.environ.get("ENGINE_TEST_MAX_TOKENS", "").strip()
    if not value:
        return None
    try:
        cap = int(value)
    except ValueError:
        cap = 0
    if cap < 1:
        raise ValueError(f"ENGINE_TEST_MAX_TOKENS must be an integer >= 1, got {value!r}")
    return cap


def cache_root() -> str:
    """ENGINE_CACHE_DIR, else ~/.cache/engine: where the engine keeps what it can rebuild."""
    return os.environ.get("ENGINE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "engine"
    )


def weight_cache_dir() -> str | None:
    """Where dequantized weights are cached (engine/model/weight_cache.py): ENGINE_WEIGHT_CACHE_DIR,
    else ENGINE_CACHE_DIR/weights, else ~/.cache/engine/weights. None when ENGINE_WEIGHT_CACHE
    is 0, false, off or no."""
    if os.environ.get("ENGINE_WEIGHT_CACHE", "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    return os.environ.get("ENGINE_WEIGHT_CACHE_DIR") or os.path.join(cache_root(), "weights")


def cpu_isa_cap() -> str:
    """ENGINE_CPU_ISA: the most of this CPU the engine, torch, oneDNN and the C kernels may use,
    "avx2", "avx512", "avx512bf16" or "native" (the default: all of it); engine/cpu_isa.py.
    Acts on torch only when set before torch is imported, i.e. in the process's environment."""
    value = os.environ.get("ENGINE_CPU_ISA", "native").strip().lower() or "native"
    if value not in ("avx2", "avx512", "avx512bf16", "native"):
        raise ValueError(
            f"ENGINE_CPU_ISA must be one of avx2, avx512, avx512bf16, native, got {value!r}"
        )
    return value
