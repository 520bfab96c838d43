"""Weight-only int8: per-output-channel symmetric scales from the float weights, and the matmul.

Decode at small batch streams every weight once per step, so its speed is bytes of weights per
step: int8 halves bf16's. The matmul is the kernels' ``int8_matmul``: on CUDA a Triton kernel
that widens the int8 weight in registers; on a CPU a weight-streaming kernel for a few rows, a
tiled GEMM in x's dtype or float32 for more (engine/kernels/int8_matmul.py).
Activations and scales are in the model's dtype: bf16, fp16 or float32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine import kernels


class QuantizedWeight(NamedTuple):
    qweight: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out], the activation dtype: w ~= qweight * scales[:, None]


def quantize_int8(weight: torch.Tensor, dtype: torch.dtype) -> QuantizedWeight:
    """Symmetric per-row int8 of a [out, in] float weight; scales in ``dtype``."""
    w = weight.float()
    amax = w.abs().amax(dim=1).clamp(min=1e-8)
    scales = (amax / 127.0).to(dtype)
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight(q.contiguous(), scales)


def dequantize_int8(qw: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    return qw.qweight.to(dtype) * qw.scales.to(dtype)[:, None]


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """y = x (qweight * scales)^T + bias, x [..., in] in scales' dtype (16-bit or float32)."""
    shape = x.shape
    y = kernels.int8_matmul(x.reshape(-1, shape[-1]), qweight, scales)
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], qweight.shape[0])
