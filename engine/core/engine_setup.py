"""How an engine is put together: the device, the model, the paged cache and its manager, the KV
connector through the engine's seam, the scheduler and the model runner; then the device's own
start (the Triton warm-up and the CUDA graphs on a GPU, one log line on a CPU).

``LLMEngine`` calls ``build_parts`` once and keeps what it returns; nothing here runs a step.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine import cpu_isa, envs
from engine.config import EngineConfig, ModelConfig
from engine.core.cache_plan import plan_cache
from engine.core.device_memory import MemoryBaseline, select_device
from engine.core.device_resolution import (
    dtype_reason,
    resolved_device,
    resolved_dtype,
    resolved_kv_dtype,
    resolved_weight_dtype,
)
from engine.core.model_runner import ModelRunner
from engine.core.scheduler import Scheduler
from engine.kernels.variants import ModelShape
from engine.kv_connector.base import KVConnector
from engine.kvcache.block_pool import BlockListener
from engine.kvcache.kv_cache_manager import KVCacheManager
from engine.kvcache.paged_cache import PagedKVCache
from engine.model.builder import build_model
from engine.model.llama import LlamaForCausalLM
from engine.model.tokenizer import Tokenizer

logger = logging.getLogger("engine")

ConnectorFactory = Callable[[PagedKVCache, KVConnector | None], KVConnector]
"""Builds the connector an engine uses from its paged cache (``cache.kv``, ``cache.block_size``)
and ``inner``, the KV-pool connector the engine built from ``config.kv_pool`` (None without a
pool), which the connector it returns wraps or replaces (a cluster worker's KV sender/receiver)."""


@dataclass(frozen=True)
class EngineParts:
    """What one engine runs on. ``config`` is the user's with this device's scheduler defaults
    filled in; ``budget_set``: the user chose the step's token budget."""

    config: EngineConfig
    budget_set: bool
    device: torch.device
    dtype: torch.dtype
    model_config: ModelConfig
    tokenizer: Tokenizer
    model_path: str
    weight_cache_hit: bool
    model: LlamaForCausalLM
    cache: PagedKVCache
    kv: KVCacheManager
    connector: KVConnector | None
    max_model_len: int
    scheduler: Scheduler
    runner: ModelRunner


def build_parts(
    config: EngineConfig,
    connector_factory: ConnectorFactory | None,
    block_listener: BlockListener | None,
) -> EngineParts:
    """Select the device, load the model, size and make the cache, bind the connector and make
    the scheduler and runner (see LLMEngine for the two seams)."""
    cap = envs.test_max_tokens()  # a bad value fails here, at start-up
    if cap is not None:
        logger.warning(
            "ENGINE_TEST_MAX_TOKENS=%d: every request's max_tokens is capped at %d "
            "(a test-only setting)",
            cap,
            cap,
        )
    # The GPU current first (Triton launches on it), its memory before the weights load.
    device = select_device(resolved_device(config))
    # The step's token budget: the user's, else this device's default (config.py).
    budget_set = config.scheduler.max_num_batched_tokens is not None
    config = dataclasses.replace(config, scheduler=config.scheduler.for_device(device.type))
    baseline = MemoryBaseline.take(device)
    dtype = resolved_dtype(config)
    torch.manual_seed(config.seed)
    built = build_model(
        config.model,
        dtype,
        device,
        show_progress=config.show_progress,
        use_cache=config.weight_cache,
        stage=config.stage,
        rope_override=config.rope_override,
        max_model_len=config.max_model_len,
    )
    model = built.model
    # The weights as they will be held (int8, or 16-bit under float32 activations) before
    # the KV pool binds: its namespace hashes them, so KV of other weights never loads.
    model.quantize_(config.quantization)
    model.store_weights_(resolved_weight_dtype(config))
    layers = len(model.layers)  # a stage's cache holds its own layers only
    kv_dtype = resolved_kv_dtype(config)
    plan = plan_cache(config, built.config, dtype, device, baseline, layers, kv_dtype)
    cc, num_blocks = plan.cache, plan.num_blocks
    cache = PagedKVCache(
        built.config,
        num_blocks,
        cc.block_size,
        kv_dtype,
        device,
        layers,
        first_layer=model.layer_range.start,
    )
    kv = KVCacheManager(
        num_blocks, cc.block_size, cc.enable_prefix_caching, listener=block_listener
    )
    connector: KVConnector | None = None
    if config.pool_spec is not None:
        from engine.kv_connector.factory import make_pool_connector

        connector = make_pool_connector(config.pool_spec, built.config, model, cache, device)
    if connector_factory is not None:
        connector = connector_factory(cache, connector)
    scheduler = Scheduler(config.scheduler, kv, connector, prefill_only=not config.stage.is_whole)
    runner = ModelRunner(
        model,
        cache,
        device,
        quantization=config.quantization,
        compile=config.resolved_compile(),
        pack_weights=config.pack_weights,
        deterministic=config.deterministic,
    )
    return EngineParts(
        config, budget_set, device, dtype, built.config, built.tokenizer, built.path,
        built.cache_hit, model, cache, kv, connector, plan.max_model_len, scheduler, runner,
    )  # fmt: skip


def start_device(parts: EngineParts) -> None:
    """The device's own start: on CUDA the kernel warm-up and the graphs, on a CPU a log line."""
    if parts.device.type == "cpu":
        log_cpu(parts)
    elif parts.device.type == "cuda":
        prepare_gpu(parts)


def prepare_gpu(parts: EngineParts) -> None:
    """Before serving on CUDA: compile every Triton kernel variant this engine's shapes need
    (kernels/variants.py), then capture the decode CUDA graphs unless told not to."""
    from engine.core.cuda_graphs import CudaGraphBackend
    from engine.kernels.variants import warm_up

    config, runner = parts.config, parts.runner
    if envs.kernel_backend() == "torch":
        # The torch references read sequence lengths on the host (.tolist()), which a graph
        # capture refuses: they are for checking the Triton kernels, not for speed.
        logger.info("CUDA graphs off: ENGINE_KERNELS=torch runs the torch reference kernels")
        return
    shape = kernel_shape(parts.model_config, config.quantization == "int8")
    cache = parts.cache
    count, seconds = warm_up(shape, cache.block_size, parts.dtype, parts.device, cache.dtype)
    logger.info("warm-up: %d Triton kernel variants compiled in %.1f s", count, seconds)
    if config.enforce_eager:
        logger.info("CUDA graphs off (enforce_eager): decode steps run eagerly")
    elif not config.stage.is_whole:
        logger.info("CUDA graphs off on pipeline stage %s: stages only prefill", config.stage)
    elif runner.compiled:
        logger.info("CUDA graphs off under compile: decode steps run eagerly")
    else:
        runner.enable_graphs(
            config.scheduler.max_num_seqs, parts.max_model_len, CudaGraphBackend(parts.device)
        )


def log_cpu(parts: EngineParts) -> None:
    """One line on the CPU (engine/cpu_isa.py) and what this engine runs on it; a warning
    where its 16-bit dtype is not native to the CPU and so runs slower than float32."""
    isa = cpu_isa.this_cpu()
    config, runner = parts.config, parts.runner
    dtype = str(parts.dtype).removeprefix("torch.")
    on = {True: "on", False: "off"}
    weights = config.quantization or str(parts.model.weight_dtype).removeprefix("torch.")
    logger.info(
        "%s; this engine: %s%s (%s), %s KV cache, packed bf16 weights %s, C decoder layers "
        "%s, deterministic %s, %d tokens per step (%s)",
        isa.describe(),
        dtype,
        f" with {weights} weights" if weights != dtype else "",
        dtype_reason(config),
        str(parts.cache.kv.dtype).removeprefix("torch."),
        on[bool(runner.packed)],
        on[bool(runner.native_decode)],
        "on (every step by the C layers)" if parts.model.deterministic else "off",
        parts.scheduler.config.max_num_batched_tokens,
        "--max-num-batched-tokens" if parts.budget_set else "the CPU default",
    )
    note = isa.slow_dtype_note(dtype)
    if note:
        logger.warning(note)


def kernel_shape(m: ModelConfig, int8: bool) -> ModelShape:
    """What the Triton kernels see of model ``m`` (kernels/variants.py); ``int8``: its
    projections and LM head are int8 GEMMs."""
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    projections = (
        (q + 2 * kv, m.hidden_size),
        (m.hidden_size, q),
        (2 * m.intermediate_size, m.hidden_size),
        (m.hidden_size, m.intermediate_size),
        (m.vocab_size, m.hidden_size),
    )
    return ModelShape(
        m.num_heads,
        m.num_kv_heads,
        m.head_dim,
        m.num_layers,
        m.qk_norm,
        projections if int8 else (),
    )
