"""The fixed-order GEMM: y = x W^T in float32 for any number of rows, one order for every output
element (engine/kernels/native/gemm.h), so that a row's result never depends on the rows beside
it, on the thread count, or on whether it runs in a prefill chunk or a decode step.

W is packed once in panels of ``PANEL`` rows (``pack_panels``): ``[ceil(N / PANEL), K, PANEL]``
in the weight's dtype, zero past N. Every output is the float32 chain
``acc = fma(x[m, k], w[n, k], acc)`` over k = 0..K-1 from zero. ``gemm_ref`` computes that chain
in torch (slowly, for the tests), ``gemm_native`` runs the C kernel; the two agree bit for bit.
"""

from __future__ import annotations

import torch

from engine.kernels._launch import check_tensor

PANEL = 16  # gemm.h GEMM_NR
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> [ceil(N / PANEL), K, PANEL], same dtype, contiguous, zero past N."""
    check_tensor("w", w, ndim=2, dtypes=_FLOATS)
    n, k = w.shape
    panels = (n + PANEL - 1) // PANEL
    padded = torch.zeros(panels * PANEL, k, dtype=w.dtype, device=w.device)
    padded[:n] = w
    return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()


def gemm_ref(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] (float dtype), packed (pack_panels of W [n, K]) -> x W^T [M, n] float32, summed
    in gemm.h's order: one fma per k, in order, from zero (torch has no fma op on CPU tensors;
    float64 products and a round per step give the fused multiply-add's result exactly, since
    a product of two floats is exact in float64 and the sum is rounded once)."""
    check_tensor("x", x, ndim=2, dtypes=_FLOATS)
    w = packed.transpose(1, 2).reshape(-1, packed.shape[1])[:n].double()  # [n, K]
    xd = x.double()
    acc = torch.zeros(x.shape[0], n, dtype=torch.float32)
    for k in range(x.shape[1]):
        acc = (acc.double() + xd[:, k, None] * w[None, :, k]).float()
    return acc


def gemm_ref_bf16(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """The chain of a step in bf16 (x and the weights bf16) on a CPU with AVX512-BF16 (gemm.h
    gemm_packed_bf16): per output, from zero, for each pair of k (zero past K) the odd product
    added, then the even one, each sum rounded to float32 (vdpbf16ps; the products of two bf16
    values are exact in float32), results below float32's normal range flushed to zero."""
    check_tensor("x", x, ndim=2, dtypes=(torch.bfloat16,))
    check_tensor("packed", packed, ndim=3, dtypes=(torch.bfloat16,))
    k = x.shape[1]
    w = packed.transpose(1, 2).reshape(-1, packed.shape[1])[:n].float()  # [n, K]
    xf = x.float()
    if k % 2:
        w, xf = torch.nn.functional.pad(w, (0, 1)), torch.nn.functional.pad(xf, (0, 1))
    tiny = torch.finfo(torch.float32).tiny

    def ftz(t: torch.Tensor) -> torch.Tensor:
        return torch.where(t.abs() < tiny, torch.zeros_like(t), t)

    acc = torch.zeros(x.shape[0], n, dtype=torch.float32)
    for i in range(0, xf.shape[1], 2):
        acc = ftz(acc + xf[:, i + 1, None] * w[None, :, i + 1])
        acc = ftz(acc + xf[:, i, None] * w[None, :, i])
    return acc


def gemm_native(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """Same contract as gemm_ref, by the C kernel (CPU tensors); x and the weights both bf16 on a
    CPU with AVX512-BF16 (native.gemm_path() "avx512bf16"): gemm_ref_bf16's."""
    from engine.kernels import native

    check_tensor("x", x, ndim=2, dtypes=_FLOATS, last_contiguous=True)
    check_tensor("packed", packed, ndim=3, dtypes=_FLOATS, contiguous=True)
    if packed.shape[1] != x.shape[1] or packed.shape[2] != PANEL or n > packed.shape[0] * PANEL:
        raise ValueError(
            f"packed: {list(packed.shape)} does not hold {n} rows of {x.shape[1]} in panels "
            f"of {PANEL}"
        )
    lib = native.library_for(x=x, packed=packed)
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    rc = lib.engine_gemm(
        native.DTYPE_CODES[x.dtype],
        native.DTYPE_CODES[packed.dtype],
        x.data_ptr(),
        packed.data_ptr(),
        y.data_ptr(),
        x.shape[0],
        n,
        x.shape[1],
        x.stride(0),
        y.stride(0),
        torch.get_num_threads(),
    )
    if rc:
        raise ValueError(f"gemm (C kernel) failed with code {rc}")
    return y
