"""How large an engine's paged KV cache is, and so the longest request it can hold."""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.kvcache.paged_cache import bytes_per_block, choose_num_blocks

logger = logging.getLogger("engine")


class CachePlan(NamedTuple):
    cache: CacheConfig  # the config with the CPU default size filled in
    num_blocks: int
    max_model_len: int  # at most what the cache holds: one request always fits by itself


def plan_cache(
    config: EngineConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device
) -> CachePlan:
    """The cache's size from the config, the model and the memory there is; ValueError when
    ``max_model_len`` exceeds the model's positions. Logs what it chose and what it lowered."""
    max_len = config.max_model_len or model.max_position_embeddings
    if max_len > model.max_position_embeddings:
        raise ValueError(
            f"max_model_len ({max_len}) must be <= the model's max_position_embeddings "
            f"({model.max_position_embeddings})"
        )
    cc = config.cache
    if device.type != "cuda":
        per_token = bytes_per_block(model, cc.block_size, dtype) // cc.block_size
        cc, chosen = cc.sized_for(per_token, max_len, config.scheduler.max_num_seqs)
        if chosen:
            logger.info(chosen)
    num_blocks = choose_num_blocks(model, cc, dtype, device)
    # One request must always fit in the cache by itself, or preemption could not help it.
    fits = min(max_len, num_blocks * cc.block_size)
    if fits < max_len:
        logger.warning(
            "max_model_len lowered from %d to %d tokens: the KV cache holds no more "
            "(raise --kv-cache-memory-gb)",
            max_len,
            fits,
        )
    return CachePlan(cc, num_blocks, fits)
