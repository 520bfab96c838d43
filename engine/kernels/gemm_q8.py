"""The W8A8 GEMM (``--quantization w8a8``): y = x W^T with 8-bit weights and 7-bit activations,
integer products summed exactly, one order for every output (engine/kernels/native/gemm_q8.h).

Both sides carry a float32 scale per block of ``BLOCK`` values along K (llama.cpp's Q8_0 blocks):
W is quantized once (``pack_q8``) to integers in [-WMAX, WMAX] = [-127, 127], each activation row
per call to [-AMAX, AMAX] = [-63, 63] with scale amax / 63 (``quantize_acts_ref``), held as q + 64
so that AVX2's vpmaddubsw (unsigned times signed, pairs summed in int16) never saturates. Every
output is the float32 chain

    acc = fma(isum_b, sa[m, b] * sw[n, b], acc)   for b = 0 .. KB - 1, from zero,

isum_b the block's exact integer dot. ``gemm_q8_ref`` computes it in torch (for the tests),
``gemm_q8_native`` runs the C kernel; the two agree bit for bit, and so do the C kernel's paths
(AVX512-VNNI, AVX2, plain C) since integer sums are exact in any order.

Error: a weight moves by at most half a step, sw / 2 = amax_w / 254 of its block's largest, an
activation by sa / 2 = amax_x / 126; an output's error is at most the sum over k of
|x| sw / 2 + |w| sa / 2 + sa sw / 4 (plus float32's roundings), which
``tests/kernels/test_gemm_q8.py`` holds the kernel to. Teacher forced on the default model
(docs/benchmarks.md): perplexity within about 1% of the float weights'.
"""

from __future__ import annotations

import torch

from engine.kernels._launch import check_tensor

BLOCK = 32  # gemm_q8.h Q8_BLOCK
WMAX = 127  # gemm_q8.h Q8_WMAX
AMAX = 63  # gemm_q8.h Q8_AMAX
OFFSET = 64  # gemm_q8.h Q8_OFFSET
PANEL = 16  # gemm.h GEMM_NR
BLOCK_BYTES = BLOCK * PANEL + PANEL * 4 + PANEL * 4  # quads, scales, -OFFSET x sums
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _blocks(k: int) -> int:
    return (k + BLOCK - 1) // BLOCK


def _pad_k(t: torch.Tensor) -> torch.Tensor:
    k = t.shape[1]
    return torch.nn.functional.pad(t, (0, _blocks(k) * BLOCK - k))


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (q [N, KB * BLOCK] int8 in [-WMAX, WMAX], zero past K; scales [N, KB]
    float32: w ~= q * scale of its block)."""
    wf = _pad_k(w.float())
    n = wf.shape[0]
    blocks = wf.view(n, -1, BLOCK)
    amax = blocks.abs().amax(dim=2)
    scales = amax / WMAX
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(blocks / safe[..., None]).clamp(-WMAX, WMAX)
    q = torch.where(scales[..., None] > 0, q, torch.zeros_like(q))
    return q.to(torch.int8).view(n, -1), scales


def pack_q8(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] float -> the W8A8 panels gemm_q8.h reads: uint8 [ceil(N / PANEL), KB,
    BLOCK_BYTES], each block the quads ([BLOCK / 4][PANEL][4] int8), the PANEL scales (float32)
    and -OFFSET x each row's block sum (int32, added to remove the activations' offset); rows
    past N zero."""
    check_tensor("w", w, ndim=2, dtypes=_FLOATS)
    q, scales = quantize_weight(w.detach().cpu())
    n, kp = q.shape
    kb, panels = kp // BLOCK, (n + PANEL - 1) // PANEL
    qp = torch.zeros(panels * PANEL, kp, dtype=torch.int8)
    qp[:n] = q
    sp = torch.zeros(panels * PANEL, kb, dtype=torch.float32)
    sp[:n] = scales
    quads = qp.view(panels, PANEL, kb, BLOCK // 4, 4).permute(0, 2, 3, 1, 4)
    sums = qp.view(panels, PANEL, kb, BLOCK).to(torch.int32).sum(dim=3) * -OFFSET
    sums = sums.to(torch.int32)
    parts = (
        quads.contiguous().view(torch.uint8).reshape(panels, kb, BLOCK * PANEL),
        sp.view(panels, PANEL, kb).transpose(1, 2).contiguous().view(torch.uint8),
        sums.transpose(1, 2).contiguous().view(torch.uint8),
    )
    return torch.cat(parts, dim=2).contiguous()


def unpack_q8(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pack_q8's inverse: (q [n, KB * BLOCK] int8, scales [n, KB] float32)."""
    panels, kb, _ = packed.shape
    quads = packed[:, :, : BLOCK * PANEL].contiguous().view(torch.int8)
    q = quads.view(panels, kb, BLOCK // 4, PANEL, 4).permute(0, 3, 1, 2, 4).reshape(-1, kb * BLOCK)
    s = packed[:, :, BLOCK * PANEL : BLOCK * PANEL + PANEL * 4].contiguous().view(torch.float32)
    return q[:n], s.transpose(1, 2).reshape(-1, kb)[:n]


def quantize_acts_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (float values, finite) -> (q [M, KB * BLOCK] in [-AMAX, AMAX] as int16, zero
    past K; scales [M, KB] float32): gemm_q8.h q8_quant_row's integers, q = rint(x * (63 /
    amax)) and scale amax / 63 per block (0 for a block of zeros)."""
    xf = _pad_k(x.float())
    blocks = xf.view(xf.shape[0], -1, BLOCK)
    amax = blocks.abs().amax(dim=2)
    # a tensor over a tensor: torch computes ``scalar / tensor`` as reciprocal times scalar, two
    # roundings, where C's 63.f / amax is one
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    inv = torch.where(amax > 0, torch.full_like(amax, AMAX) / safe, torch.zeros_like(amax))
    q = torch.round(blocks * inv[..., None])  # round half to even, as rint
    return q.to(torch.int16).view(xf.shape[0], -1), amax / AMAX


def gemm_q8_ref(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K], packed (pack_q8 of W [n, K]) -> [M, n] float32 by gemm_q8.h's chain (slowly:
    the block dots exactly in float64, each fma as a float64 product, exact for these operands
    (|isum| < 2^18 times a 24-bit scale), and its sum with acc rounded once, fma_f32)."""
    check_tensor("x", x, ndim=2, dtypes=_FLOATS)
    qw, sw = unpack_q8(packed, n)
    qa, sa = quantize_acts_ref(x)
    m, kb = sa.shape
    isum = torch.einsum(
        "mbi,nbi->mnb", qa.double().view(m, kb, BLOCK), qw.double().view(n, kb, BLOCK)
    )
    acc = torch.zeros(m, n, dtype=torch.float32)
    for b in range(kb):
        scale = (sa[:, b, None] * sw[None, :, b]).double()
        acc = fma_f32(isum[:, :, b] * scale, acc)
    return acc


def fma_f32(p: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """float32(p + a) rounded once, p an exact float64 product, a float32: the float64 sum
    rounded to odd (its error, by TwoSum, sets the last bit) and then to float32, which is the
    exact sum's rounding to nearest even (53 bits >= 24 + 2)."""
    ad = a.double()
    s = p + ad
    bb = s - p
    err = (p - (s - bb)) + (ad - bb)
    even = (s.view(torch.int64) & 1) == 0
    s = torch.where((err != 0) & even, torch.nextafter(s, s + err), s)
    return s.float()


def gemm_q8_native(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """Same contract as gemm_q8_ref, by the C kernel (CPU tensors)."""
    from engine.kernels import native

    check_tensor("x", x, ndim=2, dtypes=_FLOATS, last_contiguous=True)
    check_tensor("packed", packed, ndim=3, dtypes=(torch.uint8,), contiguous=True)
    k = x.shape[1]
    kb, nbytes = packed.shape[1], packed.shape[2]
    if kb != _blocks(k) or nbytes != BLOCK_BYTES or n > packed.shape[0] * PANEL:
        raise ValueError(
            f"packed: {list(packed.shape)} does not hold {n} rows of {k} in W8A8 panels of "
            f"{PANEL} rows and blocks of {BLOCK}"
        )
    lib = native.library_for(x=x, packed=packed)
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    rc = lib.engine_gemm_q8(
        native.DTYPE_CODES[x.dtype],
        x.data_ptr(),
        packed.data_ptr(),
        y.data_ptr(),
        x.shape[0],
        n,
        k,
        x.stride(0),
        y.stride(0),
        torch.get_num_threads(),
    )
    if rc:
        raise ValueError(f"gemm_q8 (C kernel) failed with code {rc}")
    return y
