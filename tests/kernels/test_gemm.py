"""The fixed-order GEMM (kernels/gemm.py, native/gemm.h): the C kernel gives the reference's
chain of fused multiply-adds bit for bit, a row's result never depends on the rows beside it, the
thread count or the tile it falls in, and the sums stay within float32 rounding of exact math."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kernels import native
from engine.kernels.gemm import PANEL, gemm_native, gemm_ref, gemm_ref_bf16, pack_panels

needs_cc = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")
WEIGHTS = [torch.float32, torch.bfloat16, torch.float16]


def inputs(n, k, rows, w_dtype, x_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(w_dtype)
    x = torch.randn(rows, k, generator=g).to(x_dtype)
    return x, w


def test_panels_hold_the_weight_rows_in_k_major_order():
    w = torch.arange(3 * 5, dtype=torch.float32).view(3, 5)
    p = pack_panels(w)
    assert p.shape == (1, 5, PANEL)
    assert torch.equal(p[0, :, :3], w.T) and not p[0, :, 3:].any()  # zero past N


@needs_cc
@pytest.mark.parametrize("w_dtype", WEIGHTS)
# tiles of 6 (AVX2) and of 12 (AVX-512), and their remainders
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 11, 12, 13, 25])
def test_the_kernel_is_the_reference_chain_bit_for_bit(rows, w_dtype):
    # 37 outputs: two panels, the second partial; K = 45: no vector-width assumption on K
    x, w = inputs(37, 45, rows, w_dtype)
    p = pack_panels(w)
    got = gemm_native(x, p, 37)
    assert torch.equal(got, gemm_ref(x, p, 37))
    exact = x.double() @ w.double().T
    bound = (x.double().abs() @ w.double().abs().T) * 45 * 2.0**-24 + 1e-30
    assert ((got.double() - exact).abs() <= bound).all()


@needs_cc
@pytest.mark.parametrize("w_dtype", WEIGHTS)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(w_dtype, x_dtype):
    # 200 rows cross the few-rows items, the 96-row blocks and every tile remainder
    x, w = inputs(70, 576, 200, w_dtype, x_dtype)
    p = pack_panels(w)
    whole = gemm_native(x, p, 70)
    for lo, hi in [(0, 1), (5, 6), (0, 7), (3, 100), (99, 200), (17, 113), (199, 200)]:
        assert torch.equal(gemm_native(x[lo:hi].contiguous(), p, 70), whole[lo:hi]), (lo, hi)


@needs_cc
def test_the_thread_count_changes_no_bit():
    x, w = inputs(300, 576, 40, torch.bfloat16)
    p = pack_panels(w)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(gemm_native(x, p, 300))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(r, results[0]) for r in results)


@needs_cc
@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 40),
    k=st.integers(1, 70),
    rows=st.integers(1, 20),
    w_dtype=st.sampled_from(WEIGHTS),
    seed=st.integers(0, 2**16),
)
def test_any_shape_is_the_reference(n, k, rows, w_dtype, seed):
    x, w = inputs(n, k, rows, w_dtype, seed=seed)
    p = pack_panels(w)
    assert torch.equal(gemm_native(x, p, n), gemm_ref(x, p, n))


@needs_cc
def test_bad_shapes_are_refused_by_name():
    x, w = inputs(20, 8, 2, torch.float32)
    with pytest.raises(ValueError, match="packed"):
        gemm_native(x, pack_panels(w)[:, :4].contiguous(), 20)
    with pytest.raises(ValueError, match="packed"):
        gemm_native(x, pack_panels(w), 40)


@needs_cc
@pytest.mark.parametrize("march, path", [("x86-64", b"c"), ("x86-64-v3", b"avx2")])
def test_every_class_gives_the_same_bits(tmp_path, march, path):
    # gemm.h's plain loops call fmaf in the kernel's order and its AVX2 and AVX-512 tiles hold
    # one chain per lane: built for x86-64 without AVX2 (a CPU below the AVX2 class) or for the
    # AVX2 class, the GEMM gives the bits of the loaded build (AVX-512 on such a CPU)
    import ctypes
    import platform
    import subprocess

    from engine.kernels.native import _HERE, DTYPE_CODES, FLAGS

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("these builds target x86-64")
    lib_path = tmp_path / f"gemm-{march}.so"
    subprocess.run(
        [native.compiler(), *FLAGS, f"-march={march}", str(_HERE / "gemm.c"), "-o",
         str(lib_path), "-lm"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    built = ctypes.CDLL(str(lib_path))
    built.engine_gemm_path.restype = ctypes.c_char_p
    assert built.engine_gemm_path() == path
    x, w = inputs(37, 300, 29, torch.bfloat16)  # 29 rows: whole and partial tiles of both widths
    p = pack_panels(w)
    y = torch.empty(29, 37)
    i64 = ctypes.c_int64
    rc = built.engine_gemm(
        DTYPE_CODES[x.dtype], DTYPE_CODES[p.dtype], ctypes.c_void_p(x.data_ptr()),
        ctypes.c_void_p(p.data_ptr()), ctypes.c_void_p(y.data_ptr()), i64(29), i64(37), i64(300),
        i64(300), i64(37), 2,
    )  # fmt: skip
    assert rc == 0
    assert torch.equal(y, gemm_native(x, p, 37))


needs_bf16_chain = pytest.mark.skipif(
    native.compiler() is None or native.gemm_path() != "avx512bf16",
    reason="bf16 steps take vdpbf16ps' chain only where the build has AVX512-BF16",
)


@needs_bf16_chain
@pytest.mark.parametrize("rows", [1, 2, 5, 12, 13, 25, 100])
@pytest.mark.parametrize("k", [45, 64])  # odd K: the last pair's second half is zero
def test_bf16_steps_take_the_avx512bf16_chain_bit_for_bit(rows, k):
    x, w = inputs(37, k, rows, torch.bfloat16, torch.bfloat16)
    p = pack_panels(w)
    got = gemm_native(x, p, 37)
    assert torch.equal(got, gemm_ref_bf16(x, p, 37))
    assert not torch.equal(got, gemm_native(x.float(), p, 37))  # not the FMA chain's bits
    bound = (x.double().abs() @ w.double().abs().T) * k * 2.0**-24 + 1e-30
    assert ((got.double() - x.double() @ w.double().T).abs() <= bound).all()
