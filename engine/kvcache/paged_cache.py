"""The paged device cache: one KV tensor for every layer, sized from config or free memory."""

from __future__ import annotations

import math

import numpy as np
import torch

from engine.config import CacheConfig, ModelConfig


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return model.num_layers * 2 * block_size * model.num_kv_heads * model.head_dim * elem


def choose_num_blocks(
    model: ModelConfig, cache: CacheConfig, dtype: torch.dtype, device: torch.device
) -> int:
    if cache.num_blocks is not None:
        return cache.num_blocks
    per_block = bytes_per_block(model, cache.block_size, dtype)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - (1 - cache.gpu_memory_utilization) * total
    else:
        budget = cache.kv_cache_memory_gb * 1024**3
    num = int(budget // per_block)
    if num < 2:
        raise ValueError(
            f"the KV cache budget ({budget / 1024**3:.2f} GiB) holds fewer than 2 blocks of "
            f"{per_block} bytes; raise kv_cache_memory_gb or gpu_memory_utilization"
        )
    return num


class PagedKVCache:
    """kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]; layer i's K is
    kv[i, 0] and V is kv[i, 1] (views, no copies)."""

    def __init__(
        self,
        model: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (model.num_layers, 2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv = lazy_zeros(shape, dtype, device)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros that cost nothing until touched. torch.zeros writes every page at once (a 4 GiB CPU
    cache took seconds of a server's start); numpy's zeros is calloc, whose large blocks are fresh
    pages that the kernel zeroes on first touch, so only the blocks in use are ever paid for.
    (Zeros, not empty: attention reads whole blocks, and garbage could hold NaNs.)"""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
