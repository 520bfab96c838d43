"""Linear projections held as plain weight tensors (no init cost), with fused variants."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.quant import int8_linear, quantize_int8


class Linear(torch.nn.Module):
    """y = x W^T (+ b). Fused projections (qkv, gate_up) are one Linear over stacked weights.
    ``quantize_int8_()`` swaps the float weight for int8 and per-row scales."""

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

    @torch.no_grad()
    def quantize_int8_(self) -> None:
        qw = quantize_int8(self.weight, self.weight.dtype)
        self.qweight, self.scales = qw.qweight, qw.scales
        self.weight = None  # the float copy is gone: int8 halves the bytes of a 16-bit weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return int8_linear(x, self.qweight, self.scales, self.bias)
        return F.linear(x, self.weight, self.bias)
