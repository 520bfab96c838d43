"""Copy whole KV blocks between the paged cache and a contiguous staging buffer.

The tiered KV pool and the layer-wise transfer use these: gather a request's blocks into one
contiguous buffer (to send or to store), scatter received blocks back into cache slots.
"""

from __future__ import annotations

import torch


def kv_gather_ref(cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """cache: [..., num_blocks, block_size, Hkv, D] (all layers [L, 2, ...] or one layer [2, ...]);
    block_ids: [N] int64; out: [..., N, block_size, Hkv, D] with the same leading dims."""
    lead = cache.dim() - 4
    out.copy_(cache.index_select(lead, block_ids.long()))
    return out


def kv_scatter_ref(src: torch.Tensor, block_ids: torch.Tensor, cache: torch.Tensor) -> None:
    """Inverse of kv_gather: src [..., N, block_size, Hkv, D] into cache blocks block_ids."""
    lead = cache.dim() - 4
    cache.index_copy_(lead, block_ids.long(), src.to(cache.dtype))
