"""The int8 KV row format (engine/kernels/kv_quant.py): the values, then their float16 scale, in
one row; each value within half a step of what was stored."""

from __future__ import annotations

import torch

from engine.kernels.kv_quant import dequantize_int8, quantize_int8


def test_an_int8_row_is_its_values_then_their_float16_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=g) * torch.tensor([0.01, 1.0, 40.0]).view(1, 3, 1)
    rows = quantize_int8(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, 66)
    scale = rows[..., 64:].contiguous().view(torch.float16).float()
    want = (x.abs().amax(-1, keepdim=True) / 127).to(torch.float16).float()
    assert torch.equal(scale, want)
    assert torch.equal(rows[..., :64], torch.round(x / scale).clamp(-127, 127).to(torch.int8))
    # each value within half a step of its row's scale (the scale's own fp16 rounding aside)
    err = (dequantize_int8(rows) - x).abs()
    assert bool((err <= 0.5 * scale * (1 + 2e-3) + 1e-12).all())
    assert int(rows[..., :64].abs().max()) == 127  # the largest value of a row uses the range


def test_a_row_of_zeros_stays_zeros():
    rows = quantize_int8(torch.zeros(2, 64))
    assert not rows.any()
    assert not dequantize_int8(rows).any()
