"""What test_native_steal.py computes twice, with a full OpenMP team and with a team of one: the
C kernels' outputs over every way they split work (int8 and float row dots, float tiles, the
decoder layers)."""

from __future__ import annotations

import math

import torch
from decode_layers import BLOCK, decode_step, random_model

from engine.kernels import native
from engine.kernels.float_matmul import float_matmul_native, native_max_rows, rounds_rows
from engine.kernels.int8_matmul import int8_matmul_native
from engine.kvcache.paged_cache import PagedKVCache
from engine.layers.native_decode import MAX_ROWS, NativeDecoder
from engine.layers.quant import quantize_int8

# (activation dtype, weights): every weight code of the C layers
LAYER_CASES = [
    (torch.float32, None),
    (torch.bfloat16, None),
    (torch.bfloat16, "int8"),
    (torch.float32, "int8"),
    (torch.float32, "bf16"),
]


def compute() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # 1000 output rows: 63 blocks of 16 (a partial last one), 56 of the float tiles' 18
    w = torch.randn(1000, 576, generator=g)
    x = torch.randn(11, 576, generator=g)
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        qw = quantize_int8(w, dtype)
        for rows in (1, 3, 11):
            xr = x[:rows].to(dtype)
            out[f"int8 {dtype} x{rows}"] = int8_matmul_native(xr, qw.qweight, qw.scales)
    for w_dtype in (torch.bfloat16, torch.float32):
        for rows in (1, 3, 6):  # 6: the AVX2 tiles (from 5 rows), row dots elsewhere
            # (where the C kernel serves; elsewhere torch's GEMM, whose bits are its own)
            if rows <= native_max_rows() and not rounds_rows(w_dtype, torch.float32):
                out[f"float {w_dtype} x{rows}"] = float_matmul_native(x[:rows], w.to(w_dtype))
    for dtype, weights in LAYER_CASES:
        if weights == "bf16" and rounds_rows(torch.bfloat16, dtype):
            continue  # AVX512-BF16 row dots: the engine gives these weights the torch layers
        out[f"layers {dtype} {weights}"] = layers_step(dtype, weights)
    return out


def layers_step(dtype: torch.dtype, weights: str | None) -> torch.Tensor:
    """The hidden states and KV of one decode step of MAX_ROWS sequences through the C layers
    of a small random model (its projections 6 to 20 blocks of 16 rows)."""
    model = random_model(dtype, bias=True)
    if weights == "int8":
        model.quantize_int8_()
    elif weights == "bf16":
        model.store_weights_(torch.bfloat16)
    seq_lens = [7 * i + 3 for i in range(MAX_ROWS)]
    g = torch.Generator().manual_seed(5)
    num_blocks = sum(math.ceil(n / BLOCK) for n in seq_lens) + 2
    cache = PagedKVCache(model.cfg, num_blocks, BLOCK, model.dtype, torch.device("cpu"))
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g).to(dtype))
    model.bind_kv_cache(cache.kv)
    positions, meta = decode_step(seq_lens, num_blocks, g)
    hidden = torch.randn(len(seq_lens), model.cfg.hidden_size, generator=g).to(dtype)
    decoder = NativeDecoder(model, native.library(), native.DTYPE_CODES)
    hidden = decoder.run(hidden, positions, meta, None)
    return torch.cat([hidden.float().flatten(), cache.kv.float().flatten()])
