"""Builds the engine's KV connector from the ``kv_pool`` string (``--kv-pool``, ``LLM(kv_pool=)``)
as the config parsed it (``EngineConfig.pool_spec``).

The string names the tiers (engine/pool_spec.py); the namespace fingerprints the model and
the cache layout, so blocks from another model, dtype or block size never load.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.kv_connector.base import KVConnector
from engine.kvcache.paged_cache import PagedKVCache
from engine.pool_spec import PoolSpec


def make_pool_connector(
    spec: PoolSpec, model_config: ModelConfig, model: torch.nn.Module, cache: PagedKVCache, device
) -> KVConnector:
    from engine.kv_connector.pool import PoolConnector
    from engine.kvstore.block_store import build_block_store
    from engine.kvstore.namespace import make_namespace

    namespace = make_namespace(model_config, model, cache.kv.dtype, cache.block_size)
    store = build_block_store(spec, namespace)
    return PoolConnector(store, cache.kv, cache.block_size)
