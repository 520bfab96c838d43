"""Rotary position embedding (rotate-half convention) with default, linear and llama3 scaling.

cos/sin are tabulated once (float32) for every position up to max_position and indexed by each
token's absolute position, so prefill chunks and decodes of any offsets share one path. The rotation
runs in float32 whatever the model dtype: positions in the thousands need the bits.
"""

from __future__ import annotations

import math

import torch

from engine.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling.kind == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.kind == "llama3":
        # Llama 3.1: leave high frequencies, divide low ones by factor, blend in between.
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(torch.nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: RopeScaling,
        device: torch.device,
    ) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling).to(device)
        t = torch.arange(max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        # sin with its first half negated: x * cos + swap_halves(x) * sin_signed is the
        # rotate-half form (-x2 * s == x2 * -s exactly) with one kernel (cat) fewer.
        half = head_dim // 2
        sin = emb.sin()
        self.register_buffer(
            "sin_signed", torch.cat((-sin[:, :half], sin[:, half:]), dim=-1), persistent=False
        )

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, Hq, D]; k [T, Hkv, D]."""
        return self.rotate(positions, q), self.rotate(positions, k)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """positions [T]; x [T, H, D] (any heads: q and k side by side rotate in one pass, as
        the decoder layer does with its fused QKV output) -> a new [T, H, D] in x's dtype."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin_signed[positions].unsqueeze(1)
        xf = x.float()
        half = x.shape[-1] // 2
        swapped = torch.cat((xf[..., half:], xf[..., :half]), dim=-1)
        return (xf * cos + swapped * sin).to(x.dtype)
