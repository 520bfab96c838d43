"""The paged device cache: one KV tensor for every layer (its size: kv_budget.py, cache_plan.py)."""

from __future__ import annotations

import math

import numpy as np
import torch

from engine.config import ModelConfig
from engine.kernels.kv_quant import row_elems


def bytes_per_block(
    model: ModelConfig, block_size: int, dtype: torch.dtype, num_layers: int | None = None
) -> int:
    """One block's bytes over ``num_layers`` layers (by default the model's; a pipeline stage's
    cache holds only its own layers)."""
    layers = model.num_layers if num_layers is None else num_layers
    elem = torch.empty((), dtype=dtype).element_size()
    return layers * 2 * block_size * model.num_kv_heads * row_elems(dtype, model.head_dim) * elem


class PagedKVCache:
    """kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, row]; layer i's K is
    kv[i, 0] and V is kv[i, 1] (views, no copies). ``dtype``: the KV cache's (kv_dtype.py); row
    is head_dim, or head_dim + 2 for int8 rows with their scale."""

    def __init__(
        self,
        model: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_layers: int | None = None,
        first_layer: int = 0,
    ) -> None:
        """``num_layers``: the layers the cache serves, by default the model's (a pipeline
        stage's cache has its own layers': len(stage_model.layers)), from global layer
        ``first_layer`` on: ``kv[i]`` is the model's layer ``layers[i]``."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        layers = model.num_layers if num_layers is None else num_layers
        self.layers = range(first_layer, first_layer + layers)  # global indices
        self.model_layers = model.num_layers
        if self.layers.stop > model.num_layers:
            raise ValueError(f"layers {self.layers} exceed the model's {model.num_layers}")
        self.dtype = dtype
        row = row_elems(dtype, model.head_dim)  # int8: the values and their scale (kv_dtype.py)
        shape = (layers, 2, num_blocks, block_size, model.num_kv_heads, row)
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
