"""A matmul with float weights for a few rows on the CPU, float32 out: y = x w^T, the LM head of a
decode step (x [rows, in], w [out, in], each float32, bf16 or fp16; sums in float32).

At a few rows torch's float32 GEMM packs the whole weight on every call: the default model's LM
head (49152 x 576) at 16 rows took ~31 ms under ENGINE_CPU_ISA=avx2 on one thread, ~4 GB/s of
weights. The C kernel (native/float_matmul.c) reads each weight row once for every row of x, in
gemv.h's row dots or tiles, and a row's sums do not depend on the rows beside it. The reference
is torch's GEMM in float32; results agree to float32 rounding (the sums' order differs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels._launch import check_tensor

# Rows up to which the C kernel serves (the C decoder layers' limit, layers/native_decode.py)
# where gemv.h has its AVX2 tiles; beyond, torch's GEMM, whose packing is then paid over enough
# rows. Measured on the LM head (one thread, ms, torch / C): under ENGINE_CPU_ISA=avx2 1 row
# 10.1 / 4.5, 8 rows 22.7 / 15.4, 16 rows 29.5 / 18.7; with AVX-512's float row dots (no tiles)
# 8 rows 19.6 / 16.7 but 16 rows 24.4 / 29.3, so there the C kernel stops at 8.
NATIVE_FLOAT_MAX_ROWS = 16
NATIVE_FLOAT_MAX_ROWS_NO_TILES = 8
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


_max_rows: dict[int, int] = {}  # by id of the loaded library: asked once, not at every step


def native_max_rows() -> int:
    """Rows up to which float_matmul_native runs the C kernel on this CPU (0: never, where the
    row dots over float weights are plain loops, cpu_isa.CpuIsa.c_float_row_dots)."""
    from engine import cpu_isa
    from engine.kernels import native

    lib = native.library()
    if not cpu_isa.this_cpu().c_float_row_dots or lib is None:
        return 0
    if id(lib) not in _max_rows:
        tiles = native.row_dot_paths().get("float") == "avx2"
        _max_rows[id(lib)] = NATIVE_FLOAT_MAX_ROWS if tiles else NATIVE_FLOAT_MAX_ROWS_NO_TILES
    return _max_rows[id(lib)]


def float_matmul_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [rows, in], w [out, in] (float dtypes). Returns x w^T [rows, out] in float32."""
    check_tensor("x", x, ndim=2, dtypes=_FLOATS)
    check_tensor("w", w, ndim=2, dtypes=_FLOATS, shape=(None, x.shape[1]))
    if x.dtype == w.dtype == torch.float32:
        return F.linear(x, w)
    return F.linear(x.float(), w.float())


def float_matmul_native(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Same contract as float_matmul_ref, on CPU tensors: up to native_max_rows() rows by the C
    kernel, more by the reference."""
    from engine.kernels import native

    check_tensor("x", x, ndim=2, dtypes=_FLOATS, last_contiguous=True)
    check_tensor("w", w, ndim=2, dtypes=_FLOATS, contiguous=True, shape=(None, x.shape[1]))
    rows = x.shape[0]
    # bf16 weights: the AVX512-BF16 row dots round the activations to bf16 (gemv.h)
    if rows > native_max_rows() or (w.dtype == torch.bfloat16 and x.dtype != torch.bfloat16):
        return float_matmul_ref(x, w)
    lib = native.library_for(x=x, w=w)
    y = torch.empty(rows, w.shape[0], dtype=torch.float32)
    rc = lib.engine_float_matmul(
        native.DTYPE_CODES[x.dtype],
        native.DTYPE_CODES[w.dtype],
        x.data_ptr(),
        w.data_ptr(),
        y.data_ptr(),
        rows,
        w.shape[0],
        w.shape[1],
        x.stride(0),
        y.stride(0),
        torch.get_num_threads(),
    )
    if rc:
        raise ValueError(f"float matmul (C kernel) failed with code {rc}")
    return y
