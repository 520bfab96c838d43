"""Write new K/V rows into paged cache slots (slot -1 = padding, skipped)."""

from __future__ import annotations

import torch


def kv_store_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value: [T, Hkv, D]; k_cache/v_cache: [num_blocks, block_size, Hkv, D];
    slot_mapping: [T] int64, slot = block * block_size + offset, -1 skipped."""
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    flat_k = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    flat_v = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    flat_k.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    flat_v.index_copy_(0, slot_mapping, value.to(v_cache.dtype))
