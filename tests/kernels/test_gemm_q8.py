"""The W8A8 GEMM (kernels/gemm_q8.py, native/gemm_q8.h): the C kernel against its torch reference
bit for bit, one order whatever the rows, the same bits on every build, the error bound, and
no int16 saturation at the worst operands."""

from __future__ import annotations

import pytest
import torch
from native_builds import build_for

from engine.kernels import native
from engine.kernels.gemm_q8 import (
    AMAX,
    BLOCK,
    WMAX,
    gemm_q8_native,
    gemm_q8_ref,
    pack_q8,
    quantize_acts_ref,
    quantize_weight,
    unpack_q8,
)

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")


def operands(m: int, n: int, k: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4).to(dtype)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    return x, w


@pytest.mark.parametrize(
    "m, n, k",
    [(1, 16, 32), (5, 37, 70), (13, 100, 576), (7, 33, 1), (4, 16, 31), (97, 48, 96), (2, 1, 64)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_the_c_kernel_gives_the_references_bits(m, n, k, dtype):
    x, w = operands(m, n, k, dtype=dtype)
    packed = pack_q8(w)
    assert torch.equal(gemm_q8_native(x, packed, n), gemm_q8_ref(x, packed, n))


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    # 1 row (weights streamed for all rows), tiles of 4 with a remainder, 96-row work items
    x, w = operands(203, 70, 200, seed=3)
    packed = pack_q8(w)
    together = gemm_q8_native(x, packed, 70)
    for rows in ([0], [5, 6, 7], list(range(97, 203)), [202]):
        assert torch.equal(gemm_q8_native(x[rows], packed, 70), together[rows])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(gemm_q8_native(x, packed, 70), together)
    finally:
        torch.set_num_threads(threads)


def test_the_error_stays_within_its_bound():
    # each weight is off by at most half its block's step sw / 2, each activation by sa / 2:
    # |y - x W^T| <= sum_k (|x| sw / 2 + |w| sa / 2 + sa sw / 4), plus float32's roundings
    m, n, k = 9, 40, 300
    x, w = operands(m, n, k, seed=1)
    got = gemm_q8_native(x, pack_q8(w), n).double()
    exact = x.double() @ w.double().T
    _, sw = quantize_weight(w)
    _, sa = quantize_acts_ref(x)
    kb = sw.shape[1]
    pad = kb * BLOCK - k
    xa = torch.nn.functional.pad(x.double().abs(), (0, pad)).view(m, kb, BLOCK).sum(2)
    wa = torch.nn.functional.pad(w.double().abs(), (0, pad)).view(n, kb, BLOCK).sum(2)
    sa, sw = sa.double(), sw.double()
    bound = xa @ sw.T / 2 + sa @ wa.T / 2 + BLOCK * (sa @ sw.T) / 4 + 1e-5 * (x.abs() @ w.abs().T)
    err = (got - exact).abs()
    assert (err <= bound).all(), (err / bound).max()
    assert err.max() > 0  # it does quantize
    # and in practice far inside: about 1% of the largest output for random operands
    assert err.max() < 0.02 * exact.abs().max()


def test_the_worst_operands_do_not_saturate():
    # vpmaddubsw sums two products (q + 64 <= 127 times |w| <= 127) in int16: at most 32258,
    # below 32767. Operands at the extremes, every sign mix, must give the exact integers.
    k, n = 64, 16
    w = torch.full((n, k), 1.0)
    w[1::2] = -1.0
    w[2, ::2] = -1.0
    x = torch.full((4, k), 3.0)
    x[1] = -3.0
    x[2, 1::2] = -3.0
    x[3, ::4] = 0.0
    packed = pack_q8(w)
    q, s = unpack_q8(packed, n)
    assert q.abs().max() == WMAX and torch.equal(s, torch.full_like(s, 1 / WMAX))
    qa, _ = quantize_acts_ref(x)
    assert qa.abs().max() == AMAX
    got = gemm_q8_native(x, packed, n)
    assert torch.equal(got, gemm_q8_ref(x, packed, n))
    torch.testing.assert_close(got, x @ w.T, rtol=1e-6, atol=1e-5)


def test_blocks_of_zeros_and_a_zero_weight_give_zeros():
    x = torch.zeros(3, 64)
    x[1, 40] = 2.0
    w = torch.zeros(20, 64)
    w[3, 40] = 0.5
    y = gemm_q8_native(x, pack_q8(w), 20)
    expected = torch.zeros(3, 20)
    expected[1, 3] = 1.0
    assert torch.equal(y, expected)


def test_packing_keeps_the_integers_and_scales():
    w = torch.randn(37, 70)
    q, s = quantize_weight(w)
    assert q.shape == (37, 96) and s.shape == (37, 3)
    assert q.abs().max() <= WMAX and (q[:, 70:] == 0).all()
    back, scales = unpack_q8(pack_q8(w), 37)
    assert torch.equal(back, q) and torch.equal(scales, s)


def test_a_packed_weight_of_other_shapes_is_refused():
    packed = pack_q8(torch.randn(16, 64))
    with pytest.raises(ValueError, match="does not hold 16 rows of 96"):
        gemm_q8_native(torch.randn(2, 96), packed, 16)
    with pytest.raises(ValueError, match="does not hold 17 rows"):
        gemm_q8_native(torch.randn(2, 64), packed, 17)


@pytest.mark.parametrize("march", ["x86-64-v4", "x86-64-v3", "x86-64"])
def test_every_build_gives_the_same_bits(tmp_path, monkeypatch, march):
    # integer sums are exact in any order: AVX-512 without VNNI and AVX2 (vpmaddubsw), the plain
    # loops, all give this build's bits (VNNI's vpdpbusd where this CPU has it)
    x, w = operands(29, 50, 200, seed=7)
    packed = pack_q8(w)
    here = gemm_q8_native(x, packed, 50)
    lib = build_for(march, tmp_path)
    expected_path = {"x86-64": "c", "x86-64-v3": "avx2"}.get(march)
    if expected_path:
        assert lib.engine_gemm_q8_path().decode() == expected_path
    monkeypatch.setattr(native, "library_for", lambda **_: lib)
    assert torch.equal(gemm_q8_native(x, packed, 50), here)
