"""The Triton kernels on every KV cache dtype the engine offers (--kv-cache-dtype): a float cache
of another dtype than the activations, and int8 rows with their fp16 scale (kernels/kv_quant.py).
The attention kernels against the torch references on the same cache; the KV store's int8 rows
bit for bit against kv_quant.quantize_int8 (the C kernels' reference too); int8 blocks through
the block gather and scatter unchanged."""

from __future__ import annotations

import pytest
import torch
from paged_inputs import TOL, random_paged_cache

from engine.kernels._launch import dot_dtype
from engine.kernels.decode_attention import decode_attention_ref, decode_attention_triton
from engine.kernels.kv_copy import kv_gather_ref, kv_gather_triton, kv_scatter_triton
from engine.kernels.kv_quant import dequantize_int8, quantize_int8
from engine.kernels.kv_store import kv_store_ref, kv_store_triton
from engine.kernels.prefill_attention import (
    prefill_attention_ref,
    prefill_attention_triton,
    prefill_config,
)

# (activations, KV cache): int8 under each float dtype; bf16 KV under float32 activations (the
# AVX2 CPUs' default); fp16 KV under bf16; float32 KV under bf16.
PAIRS = [
    (torch.float32, torch.int8),
    (torch.bfloat16, torch.int8),
    (torch.float16, torch.int8),
    (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float16),
    (torch.bfloat16, torch.float32),
]


def caches(seq_lens, kv_heads, head_dim, block_size, kv_dtype, g):
    k, v, tables = random_paged_cache(seq_lens, kv_heads, head_dim, block_size, torch.float32, g)
    if kv_dtype == torch.int8:
        return quantize_int8(k), quantize_int8(v), tables
    return k.to(kv_dtype), v.to(kv_dtype), tables


def tolerance(dtype, kv_dtype):
    # q is converted to a float cache's dtype and dotted in it (_launch.dot_dtype); the output
    # is q's dtype.
    worst = max(TOL[dtype]["rtol"], TOL.get(kv_dtype, TOL[dtype])["rtol"])
    return {"rtol": worst, "atol": worst}


@pytest.mark.parametrize("dtype,kv_dtype", PAIRS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_reads_the_cache_dtype(dtype, kv_dtype, num_splits):
    g = torch.Generator().manual_seed(1)
    lens = [1, 17, 100, 257]
    k, v, tables = caches(lens, 3, 64, 16, kv_dtype, g)
    q = torch.randn(len(lens), 9, 64, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    decode_attention_triton(q, k, v, tables, seq_lens, 0.125, out=out, num_splits=num_splits)
    ref = decode_attention_ref(q, k, v, tables, seq_lens, 0.125)
    torch.testing.assert_close(out, ref, **tolerance(dtype, kv_dtype))


@pytest.mark.parametrize("dtype,kv_dtype", PAIRS)
def test_prefill_attention_reads_the_cache_dtype(dtype, kv_dtype):
    g = torch.Generator().manual_seed(2)
    q_lens, contexts = [1, 37, 20], [45, 13, 0]
    lens = [a + b for a, b in zip(q_lens, contexts, strict=True)]
    k, v, tables = caches(lens, 2, 80, 16, kv_dtype, g)  # head_dim 80: padded, masked
    q = torch.randn(sum(q_lens), 8, 80, generator=g).to(dtype)
    cu = torch.tensor([0, 1, 38, 58], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    prefill_attention_triton(q, k, v, tables, cu, seq_lens, 80**-0.5, out=out)
    assert not out.isnan().any()
    ref = prefill_attention_ref(q, k, v, tables, cu, seq_lens, 80**-0.5)
    torch.testing.assert_close(out, ref, **tolerance(dtype, kv_dtype))


def test_int8_attention_is_close_to_the_float_cache_it_quantized():
    # What the int8 rows cost against the float32 values they came from: a few parts in a
    # thousand of the output's scale (docs/kernels.md states the bound).
    g = torch.Generator().manual_seed(3)
    lens = [300, 64]
    k, v, tables = random_paged_cache(lens, 3, 64, 16, torch.float32, g)
    q = torch.randn(2, 9, 64, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    exact = decode_attention_ref(q, k, v, tables, seq_lens, 0.125)
    int8 = decode_attention_triton(q, quantize_int8(k), quantize_int8(v), tables, seq_lens, 0.125)
    assert (int8 - exact).abs().max() < 0.02 * exact.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_kv_store_quantizes_bit_for_bit(dtype, head_dim):
    g = torch.Generator().manual_seed(4)
    tokens, heads, block_size, blocks = 21, 3, 16, 5
    fused = torch.randn(tokens, 3 * heads, head_dim, generator=g).to(dtype)
    key, value = fused[:, heads : 2 * heads], fused[:, 2 * heads :]  # strided, as the runtime
    key[0, 0] = 0.0  # a row of zeros: scale 0, values 0
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens]
    slots[3] = -1  # padding: skipped
    shape = (blocks, block_size, heads, head_dim + 2)
    k_cache = torch.full(shape, 7, dtype=torch.int8)
    v_cache = torch.full(shape, 7, dtype=torch.int8)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kv_store_triton(key, value, k_cache, v_cache, slots)
    kv_store_ref(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    flat = k_cache.view(-1, heads, head_dim + 2)
    assert torch.equal(flat[slots[0], 0], torch.zeros(head_dim + 2, dtype=torch.int8))
    untouched = torch.ones(blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert (flat[untouched] == 7).all()


def test_kv_store_rounds_half_to_even_as_the_reference():
    # Scale 1.0 exactly (max 127): x / scale lands on .5 ties, which round to the even integer.
    row = torch.zeros(64)
    row[:6] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5])
    key = row.view(1, 1, 64)
    k_cache = torch.zeros(1, 16, 1, 66, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    kv_store_triton(key, key, k_cache, v_cache, torch.tensor([5]))
    assert k_cache[0, 5, 0, :6].tolist() == [127, 2, -4, 0, 0, 2]
    assert torch.equal(k_cache[0, 5, 0], quantize_int8(row))
    assert dequantize_int8(k_cache[0, 5, 0])[:2].tolist() == [127.0, 2.0]


def test_int8_blocks_gather_and_scatter_unchanged():
    g = torch.Generator().manual_seed(5)
    values = torch.randn(2, 2, 6, 16, 3, 64, generator=g)  # [layers, K/V, blocks, bs, Hkv, D]
    kv = quantize_int8(values)
    ids = torch.tensor([4, 0, 2])
    staged = torch.empty(2, 2, 3, 16, 3, 66, dtype=torch.int8)
    kv_gather_triton(kv, ids, staged)
    assert torch.equal(staged, kv_gather_ref(kv, ids, torch.empty_like(staged)))
    fresh = torch.zeros_like(kv)
    kv_scatter_triton(staged, ids, fresh)
    assert torch.equal(fresh[:, :, ids], kv[:, :, ids])
    with pytest.raises(ValueError, match="out"):
        kv_gather_triton(kv, ids, torch.empty(2, 2, 3, 16, 3, 66, dtype=torch.float32))


def test_int8_tiles_and_dot_dtypes():
    """What the AOT table showed spill-free on sm_90 (profiling/kernels.py --aot): int8 K and V
    widened in registers leave prefill at most 32 keys a tile (16 on 16-row tiles); a float
    cache is dotted in its own dtype, q converted to it."""
    for max_q in (1, 40, 4096):
        cfg = prefill_config(max_q, 3, 64, torch.bfloat16, (9, 0), kv_converted=True)
        assert cfg.tile_n <= (16 if cfg.block_m == 16 else 32)
    assert prefill_config(4096, 3, 64, torch.bfloat16, (9, 0)).tile_n == 64
    assert dot_dtype(torch.float32, torch.bfloat16) == torch.bfloat16
    assert dot_dtype(torch.float32, torch.int8) == torch.float32
    assert dot_dtype(torch.bfloat16, torch.float16) == torch.float16
    assert dot_dtype(torch.bfloat16, torch.float32) == torch.float32
