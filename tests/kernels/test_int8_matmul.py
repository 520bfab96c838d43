"""Weight-only int8 matmul: the C kernel against float math and the torch reference, and the
dispatch."""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import engine.kernels as kernels
from engine import cpu_isa
from engine.kernels import native
from engine.kernels.int8_matmul import (
    INT8_GEMV_MAX_ROWS,
    NATIVE_INT8_MAX_ROWS,
    gemm_dtype,
    int8_matmul_blocked,
    int8_matmul_native,
    int8_matmul_ref,
)
from engine.layers.quant import dequantize_int8, quantize_int8

# the module (engine.kernels.int8_matmul is also the name of the dispatching function)
int8_module = importlib.import_module("engine.kernels.int8_matmul")

REPO = Path(__file__).resolve().parents[2]
TORCH_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
needs_cc = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")


# The activation dtypes int8 weights take (float32: --dtype float32 --quantization int8, what
# dtype=auto picks for int8 on CPUs without native bf16), and the bits each keeps of a result.
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
MANTISSA = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}


def weights(out_features, in_features, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qw = quantize_int8(torch.randn(out_features, in_features, generator=g) * 0.05, dtype)
    x = torch.randn(NATIVE_INT8_MAX_ROWS + 4, in_features, generator=g).to(dtype)
    return qw, x


@needs_cc
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("in_features", [576, 100, 1536])  # 100: tails after 64 and 16 columns
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 11, NATIVE_INT8_MAX_ROWS])  # groups of 8
def test_matches_float_math(rows, in_features, dtype):
    qw, x = weights(77, in_features, dtype)  # 77 output rows: a partial block of 16
    x = x[:rows]
    exact = x.double() @ dequantize_int8(qw, torch.float64).T
    got = int8_matmul_native(x, qw.qweight, qw.scales)
    assert got.dtype == dtype and got.shape == (rows, 77)
    # float32 sums, then one rounding to x's dtype.
    torch.testing.assert_close(got.double(), exact.to(dtype).double(), rtol=1e-2, atol=2e-3)
    if rows <= INT8_GEMV_MAX_ROWS:  # beyond, the reference rounds the weights to 16 bits first
        ref = int8_matmul_ref(x, qw.qweight, qw.scales)
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=2e-3)


@needs_cc
@pytest.mark.parametrize("dtype", DTYPES)
def test_activation_blocks_keep_the_documented_precision(dtype):
    # The kernel takes activations as int16 in blocks of 256 with a power-of-two scale: each
    # value is exact or off by at most 2^-16 of its block's largest magnitude (an outlier costs
    # its neighbours bits, a block of tiny values keeps them all). Then one rounding to x's
    # dtype (float32 x is prepared the same way: the int16 blocks come from float32 anyway).
    qw, x = weights(64, 1536 + 40, dtype, seed=1)  # a partial last block
    x = x[:4].clone()
    x[0, 3] = 900.0  # an outlier in the first block of row 0
    x[1, 300:556] *= 1e-4  # a block of tiny values in row 1
    x[2, ::7] = 0.0
    w = dequantize_int8(qw, torch.float64)
    exact = x.double() @ w.T
    got = int8_matmul_native(x, qw.qweight, qw.scales).double()
    xd = x.double()
    block_max = torch.stack([b.abs().amax(1) for b in xd.split(256, dim=1)], 1)  # [rows, blocks]
    per_value = block_max.repeat_interleave(256, dim=1)[:, : x.shape[1]] * 2**-16
    bound = per_value @ w.abs().T  # quantization of the activations
    bound += exact.abs() * 2.0 ** -MANTISSA[dtype]  # output rounding
    bound += 1e-6 * (xd.abs() @ w.abs().T)  # float32 sums
    assert ((got - exact).abs() <= bound).all(), ((got - exact).abs() / bound).max()
    # the tiny block of row 1 kept its precision: its values contribute at full precision
    row1 = x[1:2].clone()
    row1[0, :300] = 0
    row1[0, 556:] = 0
    tiny = int8_matmul_native(row1, qw.qweight, qw.scales).double()
    torch.testing.assert_close(tiny, row1.double() @ w.T, rtol=2**-7, atol=0)


@needs_cc
def test_a_row_does_not_depend_on_the_rows_beside_it_and_nan_stays_in_its_row():
    qw, x = weights(48, 576, torch.bfloat16, seed=2)
    n = NATIVE_INT8_MAX_ROWS  # two groups of 8 rows
    alone = torch.cat([int8_matmul_native(x[i : i + 1], qw.qweight, qw.scales) for i in range(n)])
    together = int8_matmul_native(x[:n], qw.qweight, qw.scales)
    assert torch.equal(alone, together)
    x = x[:3].clone()
    x[1, 10] = float("nan")
    x[2, 500] = float("inf")
    got = int8_matmul_native(x, qw.qweight, qw.scales)
    assert torch.equal(got[0], together[0])
    assert not got[1].isfinite().any() and not got[2].isfinite().any()


# Run under ENGINE_CPU_ISA=avx2 in a process of its own (the cap is read once per process).
AVX2_RUN = """
import sys, torch
from engine.kernels import native
from engine.kernels.int8_matmul import int8_matmul_native
x, qw, scales = torch.load(sys.argv[1])
torch.save((native.row_dot_paths(), int8_matmul_native(x, qw, scales)), sys.argv[1])
"""


@needs_cc
@pytest.mark.skipif(
    cpu_isa.LEVELS.index(cpu_isa.this_cpu().hardware_level) < cpu_isa.LEVELS.index("avx2"),
    reason="ENGINE_CPU_ISA=avx2 needs an x86-64-v3 CPU",
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_avx2_row_dots_give_the_bits_of_the_avx512_ones(tmp_path, dtype):
    # gemv.h's AVX2 int8 path keeps the AVX512-VNNI path's int32 lanes (exact) and float32 sums
    # lane for lane, so the two builds agree to the bit: here against this process's build.
    qw, x = weights(80, 1576, dtype, seed=3)  # a partial last block, a tail after 32 columns
    x = x[:11].clone() * 4
    x[0, 5] = 700.0
    mine = int8_matmul_native(x, qw.qweight, qw.scales)
    path = tmp_path / "io.pt"
    torch.save((x, qw.qweight, qw.scales), path)
    env = {k: v for k, v in os.environ.items() if k not in TORCH_CAPS}
    env.update(ENGINE_CPU_ISA="avx2", PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", AVX2_RUN, str(path)], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    paths, theirs = torch.load(path)
    assert paths["int8"] == "avx2"
    if native.row_dot_paths()["int8"] not in ("avx2", "avx512vnni"):
        pytest.skip(f"this build's int8 row dots are {native.row_dot_paths()['int8']}")
    assert torch.equal(mine, theirs)


@pytest.mark.parametrize("in_features", [64, 100, 200])
def test_reference_is_right_for_any_width(in_features):
    # torch._weight_int8pack_mm is wrong on the CPU for widths that are not a multiple of 16.
    qw, x = weights(20, in_features, torch.bfloat16)
    exact = x[:1].double() @ dequantize_int8(qw, torch.float64).T
    got = int8_matmul_ref(x[:1], qw.qweight, qw.scales)
    torch.testing.assert_close(
        got.double(), exact.to(torch.bfloat16).double(), rtol=1e-2, atol=2e-3
    )


# The default model's projections (out, in): fused qkv, o_proj, fused gate_up, down_proj.
MODEL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", MODEL_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("rows", [1, 7, 64, 513])  # decode sizes, then prefill sizes
def test_every_path_matches_float_math_at_the_model_shapes(rows, shape, dtype):
    # What the engine runs (kernels.int8_matmul: the C kernel up to 16 rows, the blocked GEMM
    # beyond; the torch paths without the C kernels) against the exact product.
    g = torch.Generator().manual_seed(rows)
    qw = quantize_int8(torch.randn(*shape, generator=g) * 0.05, dtype)
    x = torch.randn(rows, shape[1], generator=g).to(dtype)
    w = dequantize_int8(qw, torch.float64)
    exact = x.double() @ w.T
    got = kernels.int8_matmul(x, qw.qweight, qw.scales)
    assert got.dtype == dtype and got.shape == (rows, shape[0])
    # one rounding to x's dtype, float32 sums
    bound = exact.abs() * 2.0 ** -MANTISSA[dtype]
    bound += 1e-6 * (x.double().abs() @ w.abs().T)
    if rows <= NATIVE_INT8_MAX_ROWS or gemm_dtype(x) == torch.float32:
        # the C kernel (activations as int16: 2^-16 of the row's largest at most) or float32
        # weights (exact from 16-bit scales, one rounding from float32 ones)
        row_max = x.double().abs().amax(1, keepdim=True)
        bound += row_max * 2.0**-16 @ w.abs().sum(1, keepdim=True).T
        assert ((got.double() - exact).abs() <= bound).all()
    else:
        # a 16-bit GEMM (where the CPU multiplies the dtype): each weight rounded to it first
        bound += (x.double().abs() @ w.abs().T) * 2.0 ** -(9 if dtype == torch.bfloat16 else 12)
        assert ((got.double() - exact).abs() <= bound).all()
    ref = int8_matmul_ref(x, qw.qweight, qw.scales)
    torch.testing.assert_close(got, ref, rtol=2**-6, atol=0.05)


def test_many_rows_multiply_in_float32_where_the_cpu_lacks_16_bit_products(monkeypatch):
    x = torch.zeros(2, 16, dtype=torch.bfloat16)
    assert gemm_dtype(x.float()) == torch.float32
    for bf16, fp16 in ((True, False), (False, False), (False, True)):
        fake = dataclasses.replace(
            cpu_isa.this_cpu(), avx512_bf16=bf16, amx_bf16=False, avx512_fp16=fp16
        )
        monkeypatch.setattr(cpu_isa, "this_cpu", lambda fake=fake: fake)
        assert gemm_dtype(x) == (torch.bfloat16 if bf16 else torch.float32)
        assert gemm_dtype(x.half()) == (torch.float16 if fp16 else torch.float32)
    monkeypatch.undo()
    expected = torch.bfloat16 if cpu_isa.this_cpu().native_bf16 else torch.float32
    assert gemm_dtype(x) == expected  # under ENGINE_CPU_ISA=avx2: float32


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_blocked_path_widens_a_tile_at_a_time_and_gives_the_whole_weights_result(
    monkeypatch, dtype
):
    qw, _ = weights(200, 96, dtype, seed=4)
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(5)).to(dtype)
    whole = int8_matmul_blocked(x, qw.qweight, qw.scales)  # one tile
    assert torch.equal(whole, int8_matmul_ref(x, qw.qweight, qw.scales))
    widened = []
    real_linear = int8_module.F.linear

    def linear(a, w):
        widened.append(w.shape[0])
        return real_linear(a, w)

    itemsize = gemm_dtype(x).itemsize
    monkeypatch.setattr(int8_module, "INT8_TILE_BYTES", 48 * 96 * itemsize)  # 48-row tiles
    monkeypatch.setattr(int8_module.F, "linear", linear)
    tiled = int8_matmul_blocked(x, qw.qweight, qw.scales)
    assert widened == [48, 48, 48, 48, 8]
    assert tiled.dtype == dtype and tiled.shape == (40, 200)
    torch.testing.assert_close(tiled, whole, rtol=2**-7, atol=1e-3)
    exact = x.double() @ dequantize_int8(qw, torch.float64).T
    # (a 16-bit GEMM, where the CPU has one, rounds the weights to 16 bits first)
    torch.testing.assert_close(tiled.double(), exact.to(dtype).double(), rtol=2e-2, atol=1e-2)


@needs_cc
def test_more_rows_than_the_kernel_takes_use_the_blocked_gemm(monkeypatch):
    qw, x = weights(40, 64, torch.bfloat16)
    calls = []
    real = int8_module.int8_matmul_blocked
    monkeypatch.setattr(int8_module, "int8_matmul_blocked", lambda *a: calls.append(1) or real(*a))
    got = int8_matmul_native(x, qw.qweight, qw.scales)  # NATIVE_INT8_MAX_ROWS + 4 rows
    assert calls == [1]
    assert torch.equal(got, int8_matmul_ref(x, qw.qweight, qw.scales))


@needs_cc
def test_strided_rows_and_bad_input():
    qw, x = weights(32, 64, torch.bfloat16)
    wide = torch.zeros(3, 100, dtype=torch.bfloat16)
    wide[:, :64] = x[:3]
    torch.testing.assert_close(
        int8_matmul_native(wide[:, :64], qw.qweight, qw.scales),
        int8_matmul_native(x[:3].clone(), qw.qweight, qw.scales),
        rtol=0,
        atol=0,
    )
    with pytest.raises(ValueError, match="qweight"):
        int8_matmul_native(x, qw.qweight.float(), qw.scales)
    with pytest.raises(ValueError, match="qweight"):
        int8_matmul_native(x[:, :32], qw.qweight, qw.scales)
    with pytest.raises(ValueError, match="scales"):
        int8_matmul_native(x, qw.qweight, qw.scales[:-1])
    with pytest.raises(ValueError, match="scales"):
        int8_matmul_native(x, qw.qweight, qw.scales.half())


@needs_cc
def test_cpu_dispatch(monkeypatch):
    qw, x = weights(32, 64, torch.bfloat16)
    calls = []
    real = kernels.int8_matmul_native
    monkeypatch.setattr(kernels, "int8_matmul_native", lambda *a: calls.append(1) or real(*a))
    kernels.int8_matmul(x[:1], qw.qweight, qw.scales)
    assert calls == [1]
    monkeypatch.setenv("ENGINE_KERNELS", "torch")
    kernels.int8_matmul(x[:1], qw.qweight, qw.scales)
    assert calls == [1]
    # without the C kernel, many rows still take the blocked GEMM, not the whole-weight one
    blocked, real_blocked = [], kernels.int8_matmul_blocked
    monkeypatch.setattr(
        kernels, "int8_matmul_blocked", lambda *a: blocked.append(1) or real_blocked(*a)
    )
    kernels.int8_matmul(x[: INT8_GEMV_MAX_ROWS + 1], qw.qweight, qw.scales)
    kernels.int8_matmul(x[:INT8_GEMV_MAX_ROWS], qw.qweight, qw.scales)
    assert blocked == [1]


@pytest.mark.parametrize("kernels_env", ["auto", "torch"])
@pytest.mark.parametrize("rows", [1, INT8_GEMV_MAX_ROWS, NATIVE_INT8_MAX_ROWS, 40])
def test_float32_activations_take_every_path(monkeypatch, rows, kernels_env):
    # --dtype float32 --quantization int8: float32 x and float32 scales through the C kernel (or
    # _weight_int8pack_mm under ENGINE_KERNELS=torch) for a few rows and the blocked float32
    # GEMM for many, each within one float32 rounding plus the C kernel's int16 activations.
    monkeypatch.setenv("ENGINE_KERNELS", kernels_env)
    qw, _ = weights(96, 576, torch.float32, seed=6)
    assert qw.scales.dtype == torch.float32
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(7))
    w = dequantize_int8(qw, torch.float64)
    exact = x.double() @ w.T
    got = kernels.int8_matmul(x, qw.qweight, qw.scales)
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    bound = exact.abs() * 2.0**-24 + 1e-6 * (x.double().abs() @ w.abs().T)
    bound += x.double().abs().amax(1, keepdim=True) * 2.0**-16 @ w.abs().sum(1, keepdim=True).T
    assert ((got.double() - exact).abs() <= bound).all()
    torch.testing.assert_close(got, int8_matmul_ref(x, qw.qweight, qw.scales), rtol=1e-4, atol=1e-3)
