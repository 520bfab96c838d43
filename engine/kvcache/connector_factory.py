"""Builds the engine's KV connector from the ``kv_pool`` string (``--kv-pool``, ``LLM(kv_pool=)``).

The string names the tiers (engine/kvcache/pool_spec.py); the namespace fingerprints the model and
the cache layout, so blocks from another model, dtype or block size never load.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.kvcache.connector import KVConnector
from engine.kvcache.paged_cache import PagedKVCache


def make_pool_connector(
    spec: str, model_config: ModelConfig, model: torch.nn.Module, cache: PagedKVCache, device
) -> KVConnector:
    from engine.kvcache.block_store import build_block_store
    from engine.kvcache.namespace import make_namespace
    from engine.kvcache.pool_connector import PoolConnector
    from engine.kvcache.pool_spec import parse_pool_spec

    namespace = make_namespace(model_config, model, cache.kv.dtype, cache.block_size)
    store = build_block_store(parse_pool_spec(spec), namespace)
    return PoolConnector(store, cache.kv, cache.block_size)
