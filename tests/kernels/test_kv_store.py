"""kv_store: Triton launcher vs the torch reference, the reference vs a per-token loop."""

from __future__ import annotations

import pytest
import torch

from engine import kernels
from engine.kernels.kv_store import kv_store_ref, kv_store_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(num_tokens, heads, head_dim, num_blocks, block_size, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Per-layer views of one [L, 2, NB, BS, H, D] tensor, as the engine allocates it; poisoned.
    kv = torch.full((2, 2, num_blocks, block_size, heads, head_dim), float("nan"), dtype=dtype)
    k_cache, v_cache = kv[1, 0], kv[1, 1]
    # key/value as strided slices of a fused projection output, like the runtime's qkv split.
    fused = torch.randn(num_tokens, 3 * heads, head_dim, generator=g).to(dtype)
    key, value = fused[:, heads : 2 * heads], fused[:, 2 * heads :]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    if num_tokens > 2:
        slots[1] = -1
        slots[-1] = -1
    return kv, key, value, k_cache, v_cache, slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_tokens,heads,head_dim,block_size",
    [(37, 3, 64, 16), (1, 3, 64, 16), (20, 8, 128, 32), (9, 32, 128, 64), (5, 1, 80, 16)],
)
def test_kv_store_matches_reference(num_tokens, heads, head_dim, block_size, dtype):
    kv, key, value, k_cache, v_cache, slots = _inputs(
        num_tokens, heads, head_dim, 12, block_size, dtype
    )
    expected = kv.clone()
    kv_store_ref(key, value, expected[1, 0], expected[1, 1], slots)
    kv_store_triton(key, value, k_cache, v_cache, slots)
    # Exact copy; untouched slots (and the other layer) must still hold the NaN poison.
    torch.testing.assert_close(kv, expected, rtol=0, atol=0, equal_nan=True)
    written = slots[slots >= 0]
    assert not k_cache.flatten(0, 1)[written].isnan().any()
    assert not v_cache.flatten(0, 1)[written].isnan().any()


def test_kv_store_int32_slots_and_all_padding():
    kv, key, value, k_cache, v_cache, slots = _inputs(6, 3, 64, 4, 16, torch.float16)
    expected = kv.clone()
    kv_store_ref(key, value, expected[1, 0], expected[1, 1], slots)
    kv_store_triton(key, value, k_cache, v_cache, slots.to(torch.int32))
    torch.testing.assert_close(kv, expected, rtol=0, atol=0, equal_nan=True)
    before = kv.clone()
    kv_store_triton(key, value, k_cache, v_cache, torch.full_like(slots, -1))
    torch.testing.assert_close(kv, before, rtol=0, atol=0, equal_nan=True)


def test_kv_store_reference_matches_loop():
    kv, key, value, k_cache, v_cache, slots = _inputs(10, 3, 64, 4, 16, torch.float32)
    naive_k, naive_v = k_cache.clone(), v_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            naive_k[slot // 16, slot % 16] = key[t]
            naive_v[slot // 16, slot % 16] = value[t]
    kv_store_ref(key, value, k_cache, v_cache, slots)
    torch.testing.assert_close(k_cache, naive_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, naive_v, rtol=0, atol=0, equal_nan=True)


def test_dispatch_uses_triton_when_forced(monkeypatch):
    monkeypatch.setenv("ENGINE_KERNELS", "triton")
    kv, key, value, k_cache, v_cache, slots = _inputs(7, 3, 64, 4, 16, torch.float32)
    expected = kv.clone()
    kv_store_ref(key, value, expected[1, 0], expected[1, 1], slots)
    kernels.kv_store(key, value, k_cache, v_cache, slots)
    torch.testing.assert_close(kv, expected, rtol=0, atol=0, equal_nan=True)


def test_kv_store_rejects_bad_input():
    kv, key, value, k_cache, v_cache, slots = _inputs(6, 3, 64, 4, 16, torch.float32)
    with pytest.raises(ValueError, match="slot_mapping"):
        kv_store_triton(key, value, k_cache, v_cache, slots.float())
    with pytest.raises(ValueError, match="slot_mapping"):
        kv_store_triton(key, value, k_cache, v_cache, slots[:-1])
    with pytest.raises(ValueError, match="value"):
        kv_store_triton(key, value[:, :2], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="k_cache"):
        kv_store_triton(key, value, k_cache[..., :32], v_cache, slots)
    with pytest.raises(ValueError, match="v_cache"):
        kv_store_triton(key, value, k_cache, v_cache.to(torch.int32), slots)
    with pytest.raises(ValueError, match="key"):
        kv_store_triton(key.transpose(1, 2), value, k_cache, v_cache, slots)


def test_kv_store_casts_to_cache_dtype():
    kv, _, _, k_cache, v_cache, slots = _inputs(9, 3, 64, 4, 16, torch.bfloat16)
    key, value = torch.randn(9, 3, 64), torch.randn(9, 3, 64)
    expected = kv.clone()
    kv_store_ref(key, value, expected[1, 0], expected[1, 1], slots)
    kv_store_triton(key, value, k_cache, v_cache, slots)
    torch.testing.assert_close(kv, expected, rtol=0, atol=0, equal_nan=True)
