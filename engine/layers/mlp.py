"""SwiGLU MLP with the gate and up projections fused into one matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.linear import Linear


class GatedMLP(torch.nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, False, dtype, device)
        self.down_proj = Linear(intermediate, hidden, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
