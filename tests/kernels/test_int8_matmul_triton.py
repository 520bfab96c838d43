"""The Triton weight-only int8 matmul (int8_matmul_triton) through the interpreter, against
exact float math and the torch reference, over odd shapes and the three activation dtypes; its
tile choice; and that the dispatcher sends Triton-backed devices to it."""

from __future__ import annotations

import importlib

import pytest
import torch

import engine.kernels as kernels
from engine.kernels._launch import check_dot_shape
from engine.kernels.int8_matmul import int8_matmul_config, int8_matmul_ref, int8_matmul_triton
from engine.layers.quant import dequantize_int8, quantize_int8

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
MANTISSA = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}


def case(rows, out_features, in_features, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qw = quantize_int8(torch.randn(out_features, in_features, generator=g) * 0.05, dtype)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    return x, qw


def assert_float_math(got, x, qw, dtype):
    """float32 sums, then one rounding to x's dtype (the interpreter's cast may truncate: two
    units in the last place)."""
    w = dequantize_int8(qw, torch.float64)
    exact = x.double() @ w.T
    bound = exact.abs() * 2.0 ** -(MANTISSA[dtype] - 1) + 1e-6 * (x.double().abs() @ w.abs().T)
    err = (got.double() - exact).abs()
    assert (err <= bound).all(), float((err / bound.clamp(min=1e-30)).max())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 3, 17, 64, 130])  # 130: two 128-row tiles, one partial
@pytest.mark.parametrize("shape", [(77, 100), (33, 200), (160, 576)], ids=str)
def test_matches_float_math_and_the_reference(rows, shape, dtype):
    out_features, in_features = shape  # in: not a multiple of BLOCK_K; out: odd
    x, qw = case(rows, out_features, in_features, dtype, seed=rows)
    got = int8_matmul_triton(x, qw.qweight, qw.scales)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    assert_float_math(got, x, qw, dtype)
    # the reference rounds the dequantized weights to x's dtype before a 16-bit GEMM
    ref = int8_matmul_ref(x, qw.qweight, qw.scales)
    torch.testing.assert_close(got, ref, rtol=2**-6, atol=2e-2)


def test_strided_rows_and_a_row_alone_equals_the_row_in_a_batch():
    x, qw = case(5, 48, 96, torch.bfloat16, seed=3)
    wide = torch.zeros(5, 160, dtype=torch.bfloat16)
    wide[:, 10:106] = x
    strided = int8_matmul_triton(wide[:, 10:106], qw.qweight, qw.scales)
    assert torch.equal(strided, int8_matmul_triton(x, qw.qweight, qw.scales))
    alone = torch.cat([int8_matmul_triton(x[i : i + 1], qw.qweight, qw.scales) for i in range(5)])
    assert torch.equal(alone, strided)


def test_empty_shapes():
    x, qw = case(0, 8, 32, torch.float16)
    assert int8_matmul_triton(x, qw.qweight, qw.scales).shape == (0, 8)
    x = torch.ones(2, 0, dtype=torch.float16)
    empty_w = torch.empty(8, 0, dtype=torch.int8)
    y = int8_matmul_triton(x, empty_w, torch.ones(8, dtype=torch.float16))
    assert torch.equal(y, torch.zeros(2, 8, dtype=torch.float16))


def test_rejects_bad_input():
    x, qw = case(3, 32, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="qweight"):
        int8_matmul_triton(x, qw.qweight.float(), qw.scales)
    with pytest.raises(ValueError, match="qweight"):
        int8_matmul_triton(x[:, :32], qw.qweight, qw.scales)
    with pytest.raises(ValueError, match="scales"):
        int8_matmul_triton(x, qw.qweight, qw.scales.half())
    with pytest.raises(ValueError, match="scales"):
        int8_matmul_triton(x, qw.qweight, qw.scales[:-1])
    with pytest.raises(ValueError, match="x"):
        int8_matmul_triton(x.t().contiguous().t(), qw.qweight, qw.scales)
    with pytest.raises(ValueError, match="x"):
        int8_matmul_triton(x.to(torch.int16), qw.qweight, qw.scales)


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 33, 64, 65, 4096])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tiles_cover_the_rows_and_are_tensor_core_shapes(rows, dtype):
    block_m, block_n, block_k, warps, stages = int8_matmul_config(rows, dtype)
    check_dot_shape(block_m, block_n, block_k)  # every side >= 16 (NVIDIA's 16-bit tl.dot)
    assert block_m >= min(rows, 128) or rows > 64
    assert block_m <= max(16, 2 * rows)  # no tile mostly of padding rows
    assert warps in (4, 8) and stages >= 2


def test_the_dispatcher_takes_the_triton_kernel_where_triton_serves(monkeypatch):
    # On CUDA use_triton is true by default; ENGINE_KERNELS=triton makes it true on CPU tensors.
    # the module (engine.kernels.int8_matmul is also the name of the dispatching function)
    int8_module = importlib.import_module("engine.kernels.int8_matmul")
    x, qw = case(2, 40, 64, torch.bfloat16)
    calls = []
    real = int8_module.int8_matmul_triton
    monkeypatch.setattr(int8_module, "int8_matmul_triton", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("ENGINE_KERNELS", "triton")
    got = kernels.int8_matmul(x, qw.qweight, qw.scales)
    assert calls == [1]
    assert_float_math(got, x, qw, torch.bfloat16)
    monkeypatch.setattr(kernels, "use_triton", lambda device: device.type == "cuda")
    monkeypatch.setenv("ENGINE_KERNELS", "auto")
    kernels.int8_matmul(x, qw.qweight, qw.scales)  # a CPU tensor: not Triton
    assert calls == [1]
