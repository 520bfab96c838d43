"""The KV cache's element type (``--kv-cache-dtype``, vLLM's flag) and the int8 row format.

``auto`` keeps the activations' dtype. ``bfloat16``/``float16``/``float32`` store K and V in that
dtype whatever the activations (bf16 KV under float32 activations halves the bytes a long context
reads per step). ``int8`` stores each token's row of each KV head as ``head_dim`` int8 values
followed by its scale, a float16, in the same row:

    [q_0 .. q_{D-1} | scale (2 bytes)]        x_i ~= q_i * scale,  scale = fp16(max|x| / 127)

so the cache tensor is int8 of shape [..., kv_heads, D + 2] and a block stays one contiguous run of
bytes: the pool's tiers, the P/D transfer and the block copies move it as they move any other
dtype, and the scales can never be separated from their values. At head_dim 64 a row is 66 bytes
against bf16's 128 (1.94x the tokens per GiB). The scale per token and head (rather than per
block) is what lets a decode step write one token without requantizing its block.

The row format and its quantization (the same bits in C and in torch) live with the kernels:
engine/kernels/kv_quant.py. ``fp8`` (vLLM's spelling of a 1-byte cache) maps to int8.
"""

from __future__ import annotations

import torch

from engine.config import check_kv_cache_dtype


def resolve_kv_dtype(name: str, activations: torch.dtype) -> torch.dtype:
    """The cache tensor's torch dtype: the activations' under ``auto``, else the named one."""
    canon = check_kv_cache_dtype(name)
    return activations if canon == "auto" else getattr(torch, canon)
