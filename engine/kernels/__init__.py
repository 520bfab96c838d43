"""Entry points for the engine's hot paths. The model runtime calls only these.

Each kernel family lives in its own file as a Triton kernel, a launcher that checks its inputs, and
a plain-torch reference with the same signature; a family may also have a C kernel for the CPU
(``native/``, built at run time) behind a launcher of the same signature. Dispatch: Triton on CUDA
tensors; on CPU tensors the C kernel where the family has one and it builds here, else the
reference. ``ENGINE_KERNELS=triton|torch|native`` forces one (Triton on CPU tensors then needs
TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch

from engine import envs
from engine.kernels.decode_attention import decode_attention_native, decode_attention_ref
from engine.kernels.float_matmul import (
    float_matmul_blocked,
    float_matmul_native,
    float_matmul_ref,
)
from engine.kernels.gemm_q8 import gemm_q8_native, gemm_q8_ref
from engine.kernels.int8_matmul import (
    INT8_GEMV_MAX_ROWS,
    int8_matmul_blocked,
    int8_matmul_native,
    int8_matmul_ref,
)
from engine.kernels.kv_copy import kv_gather_ref, kv_scatter_ref
from engine.kernels.kv_store import kv_store_ref
from engine.kernels.prefill_attention import prefill_attention_ref


def use_native(device: torch.device) -> bool:
    """The C kernels (kernels/native/) on CPU tensors: by default where they build here."""
    if device.type != "cpu" or envs.kernel_backend() not in ("auto", "native"):
        return False
    from engine.kernels import native

    return native.library() is not None


def use_triton(device: torch.device) -> bool:
    backend = envs.kernel_backend()
    if backend == "auto":
        return device.type == "cuda"
    return backend == "triton"


def kv_store(key, value, k_cache, v_cache, slot_mapping) -> None:
    if use_triton(key.device):
        from engine.kernels.kv_store import kv_store_triton

        return kv_store_triton(key, value, k_cache, v_cache, slot_mapping)
    return kv_store_ref(key, value, k_cache, v_cache, slot_mapping)


def prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, **kw):
    if use_triton(q.device):
        from engine.kernels.prefill_attention import prefill_attention_triton

        return prefill_attention_triton(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, **kw
        )
    return prefill_attention_ref(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, **kw
    )


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, **kw):
    if use_triton(q.device):
        from engine.kernels.decode_attention import decode_attention_triton

        return decode_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, **kw)
    if use_native(q.device):
        return decode_attention_native(q, k_cache, v_cache, block_tables, seq_lens, scale, **kw)
    return decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, **kw)


def int8_matmul(x, qweight, scales):
    """x [rows, in] (bf16, fp16, float32) @ (qweight [out, in] int8 * scales [out])^T."""
    if use_triton(x.device):
        from engine.kernels.int8_matmul import int8_matmul_triton

        return int8_matmul_triton(x, qweight, scales)
    if use_native(x.device):
        return int8_matmul_native(x, qweight, scales)
    if x.device.type == "cpu" and x.shape[0] > INT8_GEMV_MAX_ROWS:
        return int8_matmul_blocked(x, qweight, scales)
    return int8_matmul_ref(x, qweight, scales)


def gemm_q8(x, packed, n):
    """x [rows, in] @ W^T with W8A8 panels (kernels/gemm_q8.py pack_q8 of W [n, in]), float32.
    A CPU-only family: the C kernel, or its reference (the same bits, slowly)."""
    if x.device.type != "cpu":
        raise ValueError(f"w8a8 runs on the CPU only, got x on {x.device}")
    if use_native(x.device):
        return gemm_q8_native(x, packed, n)
    return gemm_q8_ref(x, packed, n)


def float_matmul(x, w):
    """x [rows, in] @ w [out, in]^T in float32 (float dtypes; the LM head of a float32 model,
    the projections of 16-bit weights against float32 activations). A CPU-only family: the C
    kernel for a few rows, torch's GEMM otherwise (16-bit weights widened a tile at a time)."""
    if use_native(x.device):
        return float_matmul_native(x, w)
    if x.device.type == "cpu":
        return float_matmul_blocked(x, w)
    return float_matmul_ref(x, w)


def kv_gather(cache, block_ids, out):
    if use_triton(cache.device):
        from engine.kernels.kv_copy import kv_gather_triton

        return kv_gather_triton(cache, block_ids, out)
    return kv_gather_ref(cache, block_ids, out)


def kv_scatter(src, block_ids, cache) -> None:
    if use_triton(cache.device):
        from engine.kernels.kv_copy import kv_scatter_triton

        return kv_scatter_triton(src, block_ids, cache)
    return kv_scatter_ref(src, block_ids, cache)


__all__ = [
    "kv_store",
    "prefill_attention",
    "decode_attention",
    "int8_matmul",
    "float_matmul",
    "kv_gather",
    "kv_scatter",
    "use_native",
    "use_triton",
]
