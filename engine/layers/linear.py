"""Linear projections held as plain weight tensors (no init cost), with fused variants."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear(torch.nn.Module):
    """y = x W^T (+ b). Fused projections (qkv, gate_up) are one Linear over stacked weights."""

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
