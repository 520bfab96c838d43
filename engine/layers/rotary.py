"""Rotary position embedding (rotate-half convention) with default, linear, llama3, dynamic
(NTK-aware) and YaRN scaling (config.RopeScaling says what each does; the frequencies follow
Hugging Face's modeling_rope_utils, tests/layers/test_rotary.py holds them to it).

cos/sin are tabulated once (float32) for every position up to max_position and indexed by each
token's absolute position, so prefill chunks and decodes of any offsets share one path. The rotation
runs in float32 whatever the model dtype: positions in the thousands need the bits.
"""

from __future__ import annotations

import math

import torch

from engine.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
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
    elif scaling.kind == "dynamic":
        # NTK-aware: the base raised for original x factor positions, once (not per length)
        f = scaling.factor
        base = theta * (f * f - (f - 1)) ** (head_dim / (head_dim - 2))
        inv_freq = 1.0 / (base**exponents)
    elif scaling.kind == "yarn":
        inv_freq = _yarn_frequencies(head_dim, theta, scaling)
    return inv_freq


def _yarn_frequencies(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN: dimensions that turn more than beta_fast times over the original context keep their
    frequency, those under beta_slow are divided by factor, a linear ramp between."""
    old_len = scaling.original_max_position_embeddings

    def dim_for(rotations: float) -> float:  # the dimension that turns `rotations` times
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_for(scaling.beta_fast), dim_for(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    return (1.0 / (scaling.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def attention_factor(scaling: RopeScaling) -> float:
    """What cos and sin are multiplied by: YaRN's 0.1 ln(factor) + 1 (or the given value), or 1."""
    if scaling.kind != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    return 1.0 if scaling.factor <= 1 else 0.1 * math.log(scaling.factor) + 1.0


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
        scale = attention_factor(scaling)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        # sin with its first half negated: x * cos + swap_halves(x) * sin_signed is the
        # rotate-half form (-x2 * s == x2 * -s exactly) with one kernel (cat) fewer.
        half = head_dim // 2
        sin = emb.sin() * scale
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
