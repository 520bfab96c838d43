"""How large an engine's paged KV cache is, and so the longest request it can hold."""

from __future__ import annotations

import dataclasses
import logging
from typing import NamedTuple

import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.core.device_memory import MemoryBaseline
from engine.kvcache.kv_budget import (
    DeviceMemory,
    activation_reserve_bytes,
    kv_budget_bytes,
    num_blocks_for,
    sized_by,
)
from engine.kvcache.paged_cache import bytes_per_block

logger = logging.getLogger("engine")


class CachePlan(NamedTuple):
    cache: CacheConfig  # the config with the CPU default size filled in
    num_blocks: int
    max_model_len: int  # at most what the cache holds: one request always fits by itself


def activation_reserve(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> int:
    """kv_budget.activation_reserve_bytes for this engine's model and step limits."""
    return activation_reserve_bytes(
        hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size,
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        vocab_size=model.vocab_size,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        max_num_seqs=config.scheduler.max_num_seqs,
        elem_size=torch.empty((), dtype=dtype).element_size(),
    )


def plan_cache(
    config: EngineConfig,
    model: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    baseline: MemoryBaseline | None = None,
    num_layers: int | None = None,
    kv_dtype: torch.dtype | None = None,
) -> CachePlan:
    """The cache's size from the config, the model and the memory there is (on CUDA measured
    now, after the weights loaded, against ``baseline``, taken before: see kv_budget.py);
    ValueError when ``max_model_len`` exceeds the model's positions or the cache would be too
    small. Logs what it chose and what it lowered. ``num_layers``: the layers the cache holds
    (by default the model's; a pipeline stage's own), which a block's bytes count; ``kv_dtype``:
    the cache's element type (by default the activations' ``dtype``)."""
    max_len = config.max_model_len or model.max_position_embeddings
    if max_len > model.max_position_embeddings:
        raise ValueError(
            f"max_model_len ({max_len}) must be <= the model's max_position_embeddings "
            f"({model.max_position_embeddings})"
        )
    cc = config.cache
    per_block = bytes_per_block(model, cc.block_size, kv_dtype or dtype, num_layers)
    given = config.max_model_len is not None
    if cc.num_blocks is not None:
        num_blocks = cc.num_blocks
        if given and num_blocks * cc.block_size < max_len:
            raise ValueError(
                f"num_blocks ({num_blocks} of {cc.block_size} tokens) holds fewer tokens than "
                f"one sequence of max_model_len ({max_len}): raise num_blocks or lower "
                "max_model_len"
            )
    else:
        mem: DeviceMemory | None = None
        if device.type == "cuda":
            baseline = baseline or MemoryBaseline.take(device)
            # The activations of a step of the budget the engine will run (the device's default
            # when unset, config.py DEFAULT_MAX_NUM_BATCHED_TOKENS).
            sized = dataclasses.replace(config, scheduler=config.scheduler.for_device(device.type))
            mem = baseline.measure(device, activation_reserve(sized, model, dtype))
        else:
            seqs = config.scheduler.max_num_seqs
            cc, chosen = cc.sized_for(per_block // cc.block_size, max_len, seqs)
            if chosen:
                logger.info(chosen)
        budget = kv_budget_bytes(mem, cc.gpu_memory_utilization, cc.kv_cache_memory_gb)
        field = sized_by(mem, cc.kv_cache_memory_gb)
        num_blocks = num_blocks_for(budget, per_block, cc.block_size, max_len, given, field)
        if mem is not None:
            logger.info(
                "KV cache on %s: %.2f GiB, %d blocks (GPU total %.2f GiB, free %.2f, this "
                "process %.2f, activations %.2f, gpu_memory_utilization %s)",
                device, budget / 1024**3, num_blocks, mem.total / 1024**3, mem.free / 1024**3,
                mem.used / 1024**3, mem.reserve / 1024**3, cc.gpu_memory_utilization,
            )  # fmt: skip
    # One request must always fit in the cache by itself, or preemption could not help it.
    fits = min(max_len, num_blocks * cc.block_size)
    if fits < max_len:
        logger.warning(
            "max_model_len lowered from %d to %d tokens: the KV cache holds no more "
            "(raise --kv-cache-memory-gb or --gpu-memory-utilization)",
            max_len,
            fits,
        )
    return CachePlan(cc, num_blocks, fits)
