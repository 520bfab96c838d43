"""Linear projections held as plain weight tensors (no init cost), with fused variants."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import cpu_isa, kernels
from engine.kernels.gemm_q8 import pack_q8
from engine.layers.quant import int8_linear, quantize_int8

PACK_BATCH_HINT = 16  # the rows oneDNN tunes the packed layout for (decode batches)


class Linear(torch.nn.Module):
    """y = x W^T (+ b). Fused projections (qkv, gate_up) are one Linear over stacked weights.
    ``quantize_int8_()`` swaps the float weight for int8 and per-row scales, ``quantize_w8a8_()``
    for W8A8 panels (int8 activations too); ``store_weight_()``
    keeps it in a 16-bit dtype against float32 activations (EngineConfig.weight_dtype)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device
    ) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), False
        )
        self.bias = (
            torch.nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), False)
            if bias
            else None
        )
        self.qweight: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        self.q8: torch.nn.Parameter | None = None  # W8A8 panels (quantize_w8a8_)
        self.in_features, self.out_features = in_features, out_features
        self.packed: torch.Tensor | None = None  # oneDNN's blocked copy of a bf16 weight (CPU)

    @torch.no_grad()
    def pack_(self) -> bool:
        """Keep a copy of a bf16 CPU weight in oneDNN's blocked layout (``pack_bf16``); the
        forward then skips the per-call reorder. Returns whether it packed."""
        self.packed = pack_bf16(self.weight)
        return self.packed is not None

    @torch.no_grad()
    def quantize_int8_(self) -> None:
        qw = quantize_int8(self.weight, self.weight.dtype)
        # parameters, so that the KV pool's model digest hashes the weights as held
        self.qweight = torch.nn.Parameter(qw.qweight, False)
        self.scales = torch.nn.Parameter(qw.scales, False)
        self.weight = None  # the float copy is gone: int8 halves the bytes of a 16-bit weight

    @torch.no_grad()
    def quantize_w8a8_(self) -> None:
        """W8A8 (kernels/gemm_q8.py): the weight as 8-bit integers with a scale per block of 32,
        in the C GEMM's panels; activations are quantized per row and block as it runs. A
        parameter, so that the KV pool's model digest hashes the weights as held."""
        self.out_features, self.in_features = self.weight.shape
        self.q8 = torch.nn.Parameter(pack_q8(self.weight.detach()), False)
        self.weight = None

    @torch.no_grad()
    def store_weight_(self, dtype: torch.dtype) -> None:
        """Keep the weight in ``dtype`` (bf16 or fp16 under float32 activations): the forward
        widens it exactly (kernels.float_matmul) and decode steps stream half the bytes."""
        if self.weight is not None and self.weight.dtype != dtype:
            self.weight = torch.nn.Parameter(self.weight.data.to(dtype).contiguous(), False)
            self.packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.q8 is not None:  # rounded to x's dtype, then the bias added (the C layer's order)
            shape = x.shape
            y = kernels.gemm_q8(x.reshape(-1, shape[-1]), self.q8, self.out_features).to(x.dtype)
            if self.bias is not None:
                y = y + self.bias
            return y.view(*shape[:-1], self.out_features)
        if self.qweight is not None:
            return int8_linear(x, self.qweight, self.scales, self.bias)
        if self.weight.dtype != x.dtype:  # 16-bit weights, float32 activations (store_weight_)
            shape = x.shape
            y = kernels.float_matmul(x.reshape(-1, shape[-1]), self.weight)
            if self.bias is not None:
                y = y + self.bias
            return y.view(*shape[:-1], self.weight.shape[0])
        if self.packed is not None and x.dim() == 2 and x.dtype == torch.bfloat16:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


def pack_bf16(weight: torch.Tensor | None) -> torch.Tensor | None:
    """weight [out, in] in oneDNN's blocked layout for ``packed_linear``, or None where that does
    not apply (not bf16, not on the CPU, no oneDNN, or a CPU on which oneDNN does not pack bf16:
    without AVX-512 BW/VL/DQ or AVX-NE-CONVERT, e.g. an AVX2-only one or under
    ENGINE_CPU_ISA=avx2, where torch raises). F.linear on a bf16 CPU weight reorders it on every
    call; packed once, the same product is bit-identical and at small batches much faster
    (here, the default model's projections: 19.7 -> 13.8 ms at 1 row, 26.9 -> 17.4 ms at 16)."""
    if (
        weight is None
        or weight.dtype != torch.bfloat16
        or weight.device.type != "cpu"
        or not cpu_isa.this_cpu().onednn_packs("bfloat16")
        or not torch.backends.mkldnn.is_available()
        or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        # torch's own check too: a user's ONEDNN_MAX_CPU_ISA can lower oneDNN below this CPU
        or not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    ):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] bf16 @ a packed weight's transpose (+ bias)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
