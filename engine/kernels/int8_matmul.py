"""Weight-only int8 matmul: y = x (qweight * scales[:, None])^T, x [rows, in] in bf16, fp16 or
float32 (scales in x's dtype).

Decode at small batch streams every weight once per step, so its speed is bytes of weights per
step: int8 halves bf16's. The reference reads the int8 weight directly through
``torch._weight_int8pack_mm`` for a few rows (a GEMV-shaped kernel) and dequantizes once per call
for more rows (prefill), where the GEMM's FLOPs dominate anyway. The engine's many-row path,
int8_matmul_blocked, dequantizes a tile of output rows at a time and multiplies in float32 on a
CPU without 16-bit products (under ENGINE_CPU_ISA=avx2 a bf16 GEMM of 512 x 576 -> 1536 took 96
ms against 24 in float32; docs/cpu.md). On the CPU the few-row
case (up to NATIVE_INT8_MAX_ROWS) runs the C kernel of native/int8_matmul.c instead: over the
default model's 120 projections (weights streamed from memory, as in a decode step) 6.6 against
9.9 ms at 1 row and 7.3 against 11.7 ms at 2 rows here (profiling/bench_int8.py).
On CUDA, int8_matmul_triton: one Triton kernel for every row count, reading the int8 weight once
per tile of rows, widening it in registers and multiplying on tensor cores with float32 sums,
the scales applied to the float32 sums (no dequantized weight in memory).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.kernels._launch import (
    check_devices,
    check_dot_shape,
    check_tensor,
    dot_in_f32,
    dot_precision,
    on_tensor_device,
)

# Rows up to which torch's weight-streaming kernel beats dequantize + 16-bit GEMM (measured on
# AVX512-BF16).
INT8_GEMV_MAX_ROWS = 8
# Rows up to which the C kernel serves (gemv.h's GEMV_ROWS_LIMIT; groups of 8 rows take each
# weight row in turn; the kernel takes up to 64): beyond, dequantize + 16-bit GEMM, which wins
# from 32 rows here (profiling/bench_int8.py: 16 rows 32.3 against 36.6 ms, 32 rows 65.4 against
# 46.4).
NATIVE_INT8_MAX_ROWS = 16
# The most bytes of weight the many-row path widens at once (int8_matmul_blocked): every
# projection of the default model is one tile, in float32 too (1536 x 576 x 4 = 3.5 MB).
INT8_TILE_BYTES = 4 << 20


def gemm_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the int8 matmul multiplies many rows in: x's own on CUDA and on a CPU that
    multiplies it in hardware (``CpuIsa.multiplies``: bf16 with AVX512-BF16 or AMX), float32 on
    other CPUs, where a 16-bit GEMM converts every product and runs several times slower than
    float32 (docs/cpu.md). The float32 weights are exact there: int8 times a 16-bit scale fits
    float32's 24-bit mantissa (times a float32 scale, one rounding of 2^-24 relative)."""
    if x.device.type != "cpu" or x.dtype == torch.float32:
        return x.dtype
    from engine.cpu_isa import this_cpu

    name = str(x.dtype).removeprefix("torch.")
    return x.dtype if this_cpu().multiplies(name) else torch.float32


def int8_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [rows, in]; qweight [out, in] int8; scales [out] in x's dtype. Returns [rows, out].
    A few rows: ``_weight_int8pack_mm``, which reads the int8 weight directly; more: the whole
    weight dequantized to ``gemm_dtype(x)`` and one GEMM, rounded once to x's dtype.
    ``_weight_int8pack_mm`` returns garbage on the CPU when ``in`` is not a multiple of 16
    (torch 2.13; e.g. 1e18 for 100), so such weights are dequantized instead."""
    if x.shape[0] <= INT8_GEMV_MAX_ROWS and x.shape[1] % 16 == 0:
        return torch._weight_int8pack_mm(x.contiguous(), qweight, scales)
    dt = gemm_dtype(x)
    return F.linear(x.to(dt), qweight.to(dt) * scales.to(dt)[:, None]).to(x.dtype)


def int8_matmul_blocked(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """Same contract as int8_matmul_ref, for many rows (prefill): the weight is dequantized to
    ``gemm_dtype(x)`` a tile of output rows at a time (at most INT8_TILE_BYTES widened, so a
    large weight, e.g. a 7B model's 11008 x 4096 MLP or an LM head, never exists widened whole)
    and each tile is one GEMM against all of x, rounded once to x's dtype. Every output is the
    same dot product as in the reference (exact weights in float32, float32 sums)."""
    check_tensor("x", x, ndim=2, dtypes=(torch.bfloat16, torch.float16, torch.float32))
    check_tensor("qweight", qweight, ndim=2, dtypes=(torch.int8,), shape=(None, x.shape[1]))
    check_tensor("scales", scales, dtypes=(x.dtype,), shape=(qweight.shape[0],))
    dt = gemm_dtype(x)
    out_features, in_features = qweight.shape
    tile = max(16, INT8_TILE_BYTES // max(1, in_features * dt.itemsize) // 16 * 16)
    xd = x.to(dt)
    if tile >= out_features:
        return F.linear(xd, qweight.to(dt) * scales.to(dt)[:, None]).to(x.dtype)
    y = torch.empty(x.shape[0], out_features, dtype=x.dtype, device=x.device)
    for n0 in range(0, out_features, tile):
        n1 = min(n0 + tile, out_features)
        w = qweight[n0:n1].to(dt) * scales[n0:n1].to(dt)[:, None]
        y[:, n0:n1] = F.linear(xd, w)
    return y


def int8_matmul_native(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """Same contract as int8_matmul_ref, on CPU tensors: up to NATIVE_INT8_MAX_ROWS rows by the C
    kernel (each int8 row read once for every row of x, float32 sums), more by
    int8_matmul_blocked."""
    from engine.kernels import native

    check_tensor("x", x, ndim=2, dtypes=tuple(native.DTYPE_CODES), last_contiguous=True)
    check_tensor("qweight", qweight, ndim=2, dtypes=(torch.int8,), contiguous=True)
    check_tensor("qweight", qweight, shape=(None, x.shape[1]))
    check_tensor("scales", scales, dtypes=(x.dtype,), shape=(qweight.shape[0],), contiguous=True)
    rows = x.shape[0]
    if rows > NATIVE_INT8_MAX_ROWS:
        return int8_matmul_blocked(x, qweight, scales)
    lib = native.library_for(x=x, qweight=qweight, scales=scales)
    y = torch.empty(rows, qweight.shape[0], dtype=x.dtype)
    rc = lib.engine_int8_matmul(
        native.DTYPE_CODES[x.dtype],
        x.data_ptr(),
        qweight.data_ptr(),
        scales.data_ptr(),
        y.data_ptr(),
        rows,
        qweight.shape[0],
        qweight.shape[1],
        x.stride(0),
        y.stride(0),
        torch.get_num_threads(),
    )
    if rc:
        raise ValueError(f"int8 matmul (C kernel) failed with code {rc}")
    return y


@triton.jit
def _int8_matmul_kernel(
    x_ptr,
    w_ptr,
    scales_ptr,
    y_ptr,
    rows,
    out_features,
    in_features,
    stride_x,
    stride_w,
    stride_y,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # One [BLOCK_M, BLOCK_N] tile of y = x @ (w * scales[:, None])^T per program: the int8 tile
    # of w is widened to x's dtype in registers (exact: |w| <= 127 fits bf16's 8 bits), the dot
    # sums in float32, the scales multiply the sums once at the end. Row offsets in int64: an LM
    # head's out x in can pass 2^31.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < rows
    n_ok = offs_n < out_features
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_x + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_w + offs_k[:, None]  # [K, N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k_ok = offs_k + k0 < in_features
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0)
        if DOT_F32:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(x, w.to(x.dtype), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    scales = tl.load(scales_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    y = acc * scales[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_y + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def int8_matmul_config(rows: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for ``rows`` rows of x. Few rows
    (decode): the smallest row tile a 16-bit tl.dot takes (16) and narrow column tiles, so that a
    projection's weight is spread over many programs (each streams its int8 rows once); many
    rows (prefill): 128 x 128 tiles, compute-bound like a plain GEMM. float32 x multiplies in
    IEEE fp32 (no tensor cores: FMAs on registers), so its tiles stay at most 64 x 64 x 32, the
    largest that ptxas fits in registers without spills for sm_90 (``profiling/kernels.py
    --aot``: 128 x 128 spilled ~10 KB)."""
    if dtype == torch.float32:
        if rows <= 16:
            return 16, 32, 64, 4, 3
        return min(64, triton.next_power_of_2(rows)), 64, 32, 8, 3
    if rows <= 16:
        return 16, 32, 128, 4, 4
    if rows <= 64:
        return triton.next_power_of_2(rows), 64, 128, 4, 4
    return 128, 128, 64, 8, 3


@on_tensor_device
def int8_matmul_triton(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """Same contract as int8_matmul_ref, on CUDA tensors (CPU ones under TRITON_INTERPRET=1):
    float32 sums of x times the int8 weight, times the scale, rounded once to x's dtype."""
    check_tensor("x", x, ndim=2, dtypes=(torch.bfloat16, torch.float16, torch.float32))
    check_tensor("x", x, last_contiguous=True)
    check_tensor("qweight", qweight, ndim=2, dtypes=(torch.int8,), shape=(None, x.shape[1]))
    check_tensor("qweight", qweight, last_contiguous=True)
    check_tensor("scales", scales, dtypes=(x.dtype,), shape=(qweight.shape[0],), contiguous=True)
    check_devices(_int8_matmul_kernel, x=x, qweight=qweight, scales=scales)
    rows, in_features = x.shape
    out_features = qweight.shape[0]
    y = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    if rows == 0 or out_features == 0:
        return y
    if in_features == 0:
        return y.zero_()
    block_m, block_n, block_k, warps, stages = int8_matmul_config(rows, x.dtype)
    check_dot_shape(block_m, block_n, block_k)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(out_features, block_n))
    _int8_matmul_kernel[grid](
        x,
        qweight,
        scales,
        y,
        rows,
        out_features,
        in_features,
        x.stride(0),
        qweight.stride(0),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_F32=dot_in_f32(_int8_matmul_kernel, x.dtype),
        PRECISION=dot_precision(x.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    return y
