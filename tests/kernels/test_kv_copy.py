"""Block gather/scatter between the paged cache and a staging buffer: Triton vs torch reference."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.kv_copy import (
    as_words,
    kv_gather_ref,
    kv_gather_triton,
    kv_scatter_ref,
    kv_scatter_triton,
)

NUM_BLOCKS = 24
# (leading dims, block_size, heads, head_dim): all layers, one layer's K and V, one cache.
LAYOUTS = [((2, 2), 16, 3, 64), ((2,), 32, 8, 128), ((), 64, 1, 80)]


def _cache(lead, block_size, heads, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (*lead, NUM_BLOCKS, block_size, heads, head_dim)
    return torch.randn(shape, generator=g).to(dtype)


def _ids(n, seed=1, dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(NUM_BLOCKS, generator=g)[:n].to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [1, 5])
def test_gather_and_scatter_match_reference(layout, n, dtype):
    lead, block_size, heads, head_dim = layout
    cache = _cache(lead, block_size, heads, head_dim, dtype)
    ids = _ids(n)
    out = torch.full((*lead, n, block_size, heads, head_dim), float("nan"), dtype=dtype)
    assert kv_gather_triton(cache, ids, out) is out
    expected = kv_gather_ref(cache, ids, torch.empty_like(out))
    torch.testing.assert_close(out, expected, rtol=0, atol=0)

    src = torch.randn(out.shape).to(dtype)
    target = cache.clone()
    kv_scatter_ref(src, ids, target)
    cache[..., ids, :, :, :] = float("nan")  # poison the blocks the scatter must write
    kv_scatter_triton(src, ids, cache)
    torch.testing.assert_close(cache, target, rtol=0, atol=0)


def test_strided_cache_view_and_int32_ids():
    # One of K/V of every layer: [L, NB, ...] with a layer stride of 2 blocks' worth of tensors.
    full = _cache((3, 2), 16, 3, 64, torch.float16)
    view = full[:, 1]
    ids = _ids(4, dtype=torch.int32)
    out = torch.full((3, 4, 16, 3, 64), float("nan"), dtype=torch.float16)
    kv_gather_triton(view, ids, out)
    torch.testing.assert_close(out, view[:, ids.long()], rtol=0, atol=0)
    before_k = full[:, 0].clone()
    kv_scatter_triton(out.flip(1), ids, view)
    torch.testing.assert_close(view[:, ids.long()], out.flip(1), rtol=0, atol=0)
    torch.testing.assert_close(full[:, 0], before_k, rtol=0, atol=0)


def test_gather_and_scatter_cast_like_the_reference():
    cache = _cache((2,), 16, 3, 64, torch.bfloat16)
    ids = _ids(3)
    out = torch.full((2, 3, 16, 3, 64), float("nan"))
    kv_gather_triton(cache, ids, out)
    torch.testing.assert_close(
        out, kv_gather_ref(cache, ids, torch.empty_like(out)), rtol=0, atol=0
    )
    src = torch.randn(2, 3, 16, 3, 64)
    target = cache.clone()
    kv_scatter_ref(src, ids, target)
    kv_scatter_triton(src, ids, cache)
    torch.testing.assert_close(cache, target, rtol=0, atol=0)


def test_references_match_loop():
    cache = _cache((2, 2), 16, 3, 64, torch.float32)
    ids = _ids(5)
    out = kv_gather_ref(cache, ids, torch.empty(2, 2, 5, 16, 3, 64))
    for i, b in enumerate(ids.tolist()):
        assert torch.equal(out[:, :, i], cache[:, :, b])
    back = torch.zeros_like(cache)
    kv_scatter_ref(out, ids, back)
    for b in range(NUM_BLOCKS):
        expect = cache[:, :, b] if b in ids.tolist() else torch.zeros_like(cache[:, :, b])
        assert torch.equal(back[:, :, b], expect)


@pytest.mark.parametrize("row, dtype", [(66, torch.int8), (64, torch.bfloat16), (5, torch.int8)])
def test_references_copy_blocks_as_words_bit_for_bit(row, dtype):
    # an int8 cache's rows of 66 bytes (kv_quant.py) and any dtype: copied as whole words of
    # each block (as_words), through permuted staging and at an odd byte offset (element-wise
    # then), always the blocks' exact bytes
    g = torch.Generator().manual_seed(3)
    cache = torch.randint(-128, 127, (2, 2, NUM_BLOCKS, 16, 3, row), generator=g).to(dtype)
    ids = _ids(6)
    assert as_words(cache).dtype == torch.int64  # 16 x 3 x row bytes: whole 8-byte words
    staging = torch.empty(6, 2, 2, 16, 3, row, dtype=dtype)  # the pool's [n, layers, 2, ...]
    kv_gather_ref(cache, ids, staging.permute(1, 2, 0, 3, 4, 5))
    for i, b in enumerate(ids.tolist()):
        assert torch.equal(staging[i], cache[:, :, b])
    back = torch.zeros_like(cache)
    kv_scatter_ref(staging.permute(1, 2, 0, 3, 4, 5), ids, back)
    assert torch.equal(back[:, :, ids], cache[:, :, ids])
    odd = torch.empty(staging.numel() + 1, dtype=dtype)[1:].view(staging.shape)
    odd.copy_(staging)
    again = torch.zeros_like(cache)
    kv_scatter_ref(odd.permute(1, 2, 0, 3, 4, 5), ids, again)
    assert torch.equal(again, back)


def test_rejects_bad_input():
    cache = _cache((2,), 16, 3, 64, torch.float16)
    ids = _ids(3)
    out = torch.empty(2, 3, 16, 3, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="out"):
        kv_gather_triton(cache, ids, out[:, :2])
    with pytest.raises(ValueError, match="block_ids"):
        kv_gather_triton(cache, ids.float(), out)
    with pytest.raises(ValueError, match="block_ids"):
        kv_gather_triton(cache, ids[None], out)
    with pytest.raises(ValueError, match="src"):
        kv_scatter_triton(out.to(torch.int16), ids, cache)
    with pytest.raises(ValueError, match="cache"):
        kv_gather_triton(cache.transpose(-1, -2), ids, out.transpose(-1, -2))
    with pytest.raises(ValueError, match="cache"):
        kv_gather_triton(cache[0, 0], ids, out)
    # Leading dims that do not flatten to one stride.
    big = _cache((2, 3), 16, 3, 64, torch.float16)[:, :2]
    with pytest.raises(ValueError, match="cache"):
        kv_gather_triton(big, ids, torch.empty(2, 2, 3, 16, 3, 64, dtype=torch.float16))
