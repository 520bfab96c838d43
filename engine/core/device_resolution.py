"""What an ``EngineConfig``'s device and dtypes are on this machine.

The config holds plain values (engine/config.py: ``device="auto"``, ``dtype="auto"``,
``weight_dtype="auto"``); these functions resolve them, asking torch whether CUDA is there and
engine/cpu_isa.py what this CPU computes fastest in (under its ``ENGINE_CPU_ISA`` cap):

- device ``auto``: CUDA if available, else the CPU;
- dtype ``auto``: bfloat16 on CUDA and on CPUs with native bf16 (AVX512-BF16, AMX), float32 on
  other CPUs (bf16 there too with int8 weights: measured faster for int8 decode);
- weight_dtype ``auto``: the dtype's own, except under dtype ``auto`` on CPUs whose C row dots
  widen bf16 in registers (AVX2, AVX-512): bfloat16 weights, float32 activations;
- kv_cache_dtype ``auto``: the activations', except on those CPUs under dtype ``auto``: a
  bfloat16 KV cache under the float32 activations.
"""

from __future__ import annotations

import torch

from engine import cpu_isa
from engine.config import EngineConfig


def resolved_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def resolved_dtype(config: EngineConfig) -> torch.dtype:
    """The activations' (and the KV cache's) dtype."""
    if config.dtype == "auto":
        if resolved_device(config).type == "cuda":
            return torch.bfloat16
        return getattr(torch, cpu_isa.this_cpu().auto_dtype(config.quantization)[0])
    return getattr(torch, config.dtype)


def resolved_kv_dtype(config: EngineConfig) -> torch.dtype:
    """The KV cache's dtype (``kv_cache_dtype``; auto: the activations', except bfloat16 under
    ``dtype=auto``'s float32 activations on CPUs whose C attention widens bf16 in registers:
    cpu_isa.CpuIsa.auto_kv_dtype). Any of them runs on every device: the C kernels and the
    torch references on a CPU, the Triton kernels on CUDA (a float cache read into the
    activations' dtype, int8 rows with their scales)."""
    from engine.kvcache.kv_dtype import resolve_kv_dtype

    activations = resolved_dtype(config)
    dtype = resolve_kv_dtype(config.kv_cache_dtype, activations)
    auto = config.kv_cache_dtype == "auto" and config.dtype == "auto"
    if auto and resolved_device(config).type == "cpu":
        dtype = getattr(torch, cpu_isa.this_cpu().auto_kv_dtype(config.quantization))
    return dtype


def resolved_weight_dtype(config: EngineConfig) -> torch.dtype:
    """The dtype the float weights are held in (``weight_dtype``); int8 weights: the
    activations' dtype (their scales' and the kept LM head rows')."""
    dtype = resolved_dtype(config)
    if config.quantization is not None:
        return dtype
    if config.weight_dtype != "auto":
        weights = getattr(torch, config.weight_dtype)
        if weights != dtype and dtype != torch.float32:
            raise ValueError(
                f"weight_dtype {config.weight_dtype} with dtype auto, which is "
                f"{str(dtype).removeprefix('torch.')} here: weights other than the "
                "dtype's own take dtype float32"
            )
        return weights
    if config.dtype != "auto" or resolved_device(config).type == "cuda":
        return dtype
    return getattr(torch, cpu_isa.this_cpu().auto_weight_dtype(config.quantization))


def dtype_reason(config: EngineConfig) -> str:
    """Why resolved_dtype is what it is, for the start-up log."""
    if config.dtype != "auto":
        if config.weight_dtype not in ("auto", config.dtype) and config.quantization is None:
            return f"dtype {config.dtype} with {config.weight_dtype} weights as asked"
        return f"dtype {config.dtype} as asked"
    if resolved_device(config).type == "cuda":
        why = "auto: bfloat16 on CUDA"
    else:
        why = cpu_isa.this_cpu().auto_dtype(config.quantization)[1]
    if config.weight_dtype != "auto":
        why += f"; {config.weight_dtype} weights as asked"
    return why
