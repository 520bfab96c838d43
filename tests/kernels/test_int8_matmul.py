"""Weight-only int8 matmul: the C kernel against float math and the torch reference, and the
dispatch."""

from __future__ import annotations

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
    int8_matmul_native,
    int8_matmul_ref,
)
from engine.layers.quant import dequantize_int8, quantize_int8

REPO = Path(__file__).resolve().parents[2]
TORCH_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
needs_cc = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")


def weights(out_features, in_features, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qw = quantize_int8(torch.randn(out_features, in_features, generator=g) * 0.05, dtype)
    x = torch.randn(NATIVE_INT8_MAX_ROWS + 4, in_features, generator=g).to(dtype)
    return qw, x


@needs_cc
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_features", [576, 100, 1536])  # 100: tails after 64 and 16 columns
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 11, NATIVE_INT8_MAX_ROWS])  # groups of 8
def test_matches_float_math(rows, in_features, dtype):
    qw, x = weights(77, in_features, dtype)  # 77 output rows: a partial block of 16
    x = x[:rows]
    exact = x.double() @ dequantize_int8(qw, torch.float64).T
    got = int8_matmul_native(x, qw.qweight, qw.scales)
    assert got.dtype == dtype and got.shape == (rows, 77)
    # float32 sums, then one rounding to the 16-bit dtype.
    torch.testing.assert_close(got.double(), exact.to(dtype).double(), rtol=1e-2, atol=2e-3)
    if rows <= INT8_GEMV_MAX_ROWS:  # beyond, the reference rounds the weights to 16 bits first
        ref = int8_matmul_ref(x, qw.qweight, qw.scales)
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=2e-3)


@needs_cc
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_activation_blocks_keep_the_documented_precision(dtype):
    # The kernel takes activations as int16 in blocks of 256 with a power-of-two scale: each
    # value is exact or off by at most 2^-16 of its block's largest magnitude (an outlier costs
    # its neighbours bits, a block of tiny values keeps them all). Then one rounding to 16 bits.
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
    bound += exact.abs() * 2.0 ** -(8 if dtype == torch.bfloat16 else 11)  # output rounding
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
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
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


@needs_cc
def test_more_rows_than_the_kernel_takes_use_the_reference():
    qw, x = weights(40, 64, torch.bfloat16)
    got = int8_matmul_native(x, qw.qweight, qw.scales)  # NATIVE_INT8_MAX_ROWS + 4 rows
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
