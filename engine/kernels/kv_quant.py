"""The int8 KV row format: each token's row of each KV head as ``head_dim`` int8 values followed
by their scale, a float16, in the same row (engine/kvcache/kv_dtype.py says why):

    [q_0 .. q_{D-1} | scale (2 bytes)]        x_i ~= q_i * scale,  scale = fp16(max|x| / 127)

The quantization here is the reference of the C kernels' (native/dtypes.h ``store_i8_row``), bit
for bit: the float32 scale max|x| / 127 rounded to float16, q = round-half-even(x / scale)
clamped to [-127, 127], zeros for a row of zeros. A float cache's rows are its values.
"""

from __future__ import annotations

import torch

INT8_SCALE_BYTES = 2  # the float16 scale after a row's values


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype == torch.int8


def row_elems(dtype: torch.dtype, head_dim: int) -> int:
    """Elements of one token's row of one KV head in a cache of ``dtype``."""
    return head_dim + INT8_SCALE_BYTES if is_quantized(dtype) else head_dim


def quantize_int8(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) -> int8 rows [..., D + 2]: the values, then the fp16 scale."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / 127.0).to(torch.float16)
    s = scale.float()
    q = torch.where(s > 0, xf / torch.where(s > 0, s, 1.0), 0.0)
    q = torch.round(q).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_int8(rows: torch.Tensor) -> torch.Tensor:
    """int8 rows [..., D + 2] -> float32 [..., D] (values times their row's scale)."""
    d = rows.shape[-1] - INT8_SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float16).float()
    return rows[..., :d].float() * scale


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Rows [..., D] as a cache of ``cache_dtype`` stores them."""
    return quantize_int8(x) if is_quantized(cache_dtype) else x.to(cache_dtype)


def from_cache(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows as ``dtype`` values [..., D] (int8 rows dequantized)."""
    return dequantize_int8(rows).to(dtype) if is_quantized(rows.dtype) else rows.to(dtype)
