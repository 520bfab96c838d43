"""engine/layers/quant.py: int8 weights and int8_linear at decode and prefill sizes, against float
math (run again under ENGINE_CPU_ISA=avx2 by tests/cpu_paths.py)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.int8_matmul import NATIVE_INT8_MAX_ROWS, gemm_dtype
from engine.layers.quant import dequantize_int8, int8_linear, quantize_int8

# The default model's projections (out, in): fused qkv (with bias, as Qwen's), o_proj, fused
# gate_up, down_proj.
SHAPES = [(960, 576, True), (576, 576, False), (3072, 576, False), (576, 1536, False)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("rows", [1, 7, 64, 513])
def test_int8_linear_matches_the_float_weights_within_the_quantization(rows, shape):
    out_features, in_features, has_bias = shape
    g = torch.Generator().manual_seed(rows + out_features)
    weight = torch.randn(out_features, in_features, generator=g) * 0.05
    bias = (torch.randn(out_features, generator=g) * 0.1).bfloat16() if has_bias else None
    qw = quantize_int8(weight, torch.bfloat16)
    assert qw.qweight.dtype == torch.int8 and qw.scales.dtype == torch.bfloat16
    # per-row symmetric: each weight off by at most half a step of its row's scale
    step = qw.scales.double()[:, None]
    assert ((dequantize_int8(qw, torch.float64) - weight.double()).abs() <= step / 2 + 1e-9).all()
    x = torch.randn(rows, in_features, generator=g).bfloat16()
    got = int8_linear(x.view(1, rows, in_features), qw.qweight, qw.scales, bias)
    assert got.shape == (1, rows, out_features) and got.dtype == torch.bfloat16
    got = got[0].double()
    xd = x.double()
    w = dequantize_int8(qw, torch.float64)
    exact = xd @ w.T + (bias.double() if bias is not None else 0)
    # the matmul's output rounded to bf16, then the bias added and rounded again
    bound = (xd @ w.T).abs() * 2.0**-8 + exact.abs() * 2.0**-8 + 1e-6 * (xd.abs() @ w.abs().T)
    if rows <= NATIVE_INT8_MAX_ROWS or gemm_dtype(x) == torch.float32:
        bound += xd.abs().amax(1, keepdim=True) * 2.0**-16 @ w.abs().sum(1, keepdim=True).T
    else:  # a bf16 GEMM rounds each weight to bf16 first
        bound += (xd.abs() @ w.abs().T) * 2.0**-9
    assert ((got - exact).abs() <= bound).all(), ((got - exact).abs() / bound).max()
    # and against the float weights: the quantization's half step per weight
    float_exact = xd @ weight.double().T + (bias.double() if bias is not None else 0)
    quant = xd.abs() @ (step / 2).expand(-1, in_features).T
    assert ((got - float_exact).abs() <= bound + quant).all()


def test_prefill_rows_are_computed_in_float32_without_16_bit_products():
    # Under ENGINE_CPU_ISA=avx2 (no AVX512-BF16) the prefill path must not take a bf16 GEMM,
    # which there runs several times slower than float32 (docs/cpu.md).
    from engine.cpu_isa import this_cpu

    x = torch.zeros(600, 64, dtype=torch.bfloat16)
    assert gemm_dtype(x) == (torch.bfloat16 if this_cpu().native_bf16 else torch.float32)
