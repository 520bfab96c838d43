"""A matmul with float weights for a few rows on the CPU, float32 out: y = x w^T, the LM head of a
decode step (x [rows, in], w [out, in], each float32, bf16 or fp16; sums in float32).

At a few rows torch's float32 GEMM packs the whole weight on every call: the default model's LM
head (49152 x 576) at 16 rows took ~31 ms under ENGINE_CPU_ISA=avx2 on one thread, ~4 GB/s of
weights. The C kernel (native/float_matmul.c) reads each weight row once for every row of x, in
gemv.h's row dots or tiles, and a row's sums do not depend on the rows beside it. The reference
is torch's GEMM in float32; results agree to float32 rounding (the sums' order differs).

16-bit weights against float32 rows (``EngineConfig.weight_dtype``: bf16 weights, float32
activations) are widened exactly: the C row dots shift bf16 (F16C for fp16) into float32
registers, and for more rows float_matmul_blocked widens a tile of weight rows at a time for
torch's float32 GEMM, never the whole weight (an LM head is 113 MB in float32).
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
# The most bytes of weight float_matmul_blocked widens at once: every projection of the default
# model is one tile (gate_up 3072 x 576 x 4 = 7 MB), its LM head (113 MB in float32) 4, a 7B
# model's MLP 6. Each tile's output is copied into place: with 4 MB tiles a 1024-token prefill
# of bf16 weights under ENGINE_CPU_ISA=avx2 took 2.43 against float32's 2.19 s, with 32 MB 2.09
# against 2.00 (and 5.09 against 5.40 at 2048 tokens: level, within the machine's noise).
FLOAT_TILE_BYTES = 32 << 20


# By id of the loaded library, asked once, not at every step: (rows up to which the C kernel
# serves, whether its bf16 row dots round float32 rows to bf16).
_paths: dict[int, tuple[int, bool]] = {}


def _library_paths() -> tuple[int, bool]:
    from engine import cpu_isa
    from engine.kernels import native

    lib = native.library()
    if lib is None:
        return 0, False
    if id(lib) not in _paths:
        paths = native.row_dot_paths()
        tiles = paths.get("float") == "avx2"
        rows = NATIVE_FLOAT_MAX_ROWS if tiles else NATIVE_FLOAT_MAX_ROWS_NO_TILES
        _paths[id(lib)] = (rows, paths.get("bf16") == "avx512bf16")
    rows, rounds = _paths[id(lib)]
    return (rows if cpu_isa.this_cpu().c_float_row_dots else 0), rounds


def native_max_rows() -> int:
    """Rows up to which float_matmul_native runs the C kernel on this CPU (0: never, where the
    row dots over float weights are plain loops, cpu_isa.CpuIsa.c_float_row_dots)."""
    return _library_paths()[0]


def rounds_rows(w_dtype: torch.dtype, x_dtype: torch.dtype) -> bool:
    """Whether the loaded C row dots would round float32 rows against ``w_dtype`` weights: the
    AVX512-BF16 ones (``vdpbf16ps``) take bf16 rows, so bf16 weights against float32 rows go to
    torch there (elsewhere bf16 is shifted into float32 registers and the rows stay exact)."""
    return w_dtype == torch.bfloat16 and x_dtype != torch.bfloat16 and _library_paths()[1]


def float_matmul_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [rows, in], w [out, in] (float dtypes). Returns x w^T [rows, out] in float32."""
    check_tensor("x", x, ndim=2, dtypes=_FLOATS)
    check_tensor("w", w, ndim=2, dtypes=_FLOATS, shape=(None, x.shape[1]))
    if x.dtype == w.dtype == torch.float32:
        return F.linear(x, w)
    return F.linear(x.float(), w.float())


def float_matmul_blocked(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Same contract as float_matmul_ref, for many rows with 16-bit weights: the weight is
    widened to float32 a tile of at most FLOAT_TILE_BYTES at a time and each tile is one GEMM
    against all of x (the same products and float32 sums as the reference)."""
    check_tensor("x", x, ndim=2, dtypes=_FLOATS)
    check_tensor("w", w, ndim=2, dtypes=_FLOATS, shape=(None, x.shape[1]))
    out_features, in_features = w.shape
    tile = max(16, FLOAT_TILE_BYTES // max(1, in_features * 4) // 16 * 16)
    if w.dtype == torch.float32 or tile >= out_features:
        return float_matmul_ref(x, w)
    xf = x.float()
    y = torch.empty(x.shape[0], out_features, dtype=torch.float32, device=x.device)
    for n0 in range(0, out_features, tile):
        n1 = min(n0 + tile, out_features)
        y[:, n0:n1] = F.linear(xf, w[n0:n1].float())
    return y


def float_matmul_native(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Same contract as float_matmul_ref, on CPU tensors: up to native_max_rows() rows by the C
    kernel, more by the reference (16-bit weights: float_matmul_blocked)."""
    from engine.kernels import native

    check_tensor("x", x, ndim=2, dtypes=_FLOATS, last_contiguous=True)
    check_tensor("w", w, ndim=2, dtypes=_FLOATS, contiguous=True, shape=(None, x.shape[1]))
    rows = x.shape[0]
    if rows > native_max_rows() or rounds_rows(w.dtype, x.dtype):
        return float_matmul_blocked(x, w)
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
