"""Small namespaces and blocks for the block-store tests (no model needed)."""

from __future__ import annotations

import hashlib

from engine.kvstore.namespace import KVNamespace


def small_namespace(digest: str = "test-model") -> KVNamespace:
    # 2 layers x (K, V) x 4 tokens x 1 head x 8 dims x 2 bytes = 256 bytes per block
    return KVNamespace(digest, "float16", block_size=4, num_layers=2, num_kv_heads=1, head_dim=8)


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def block(i: int, nbytes: int = 256) -> bytes:
    return (hashlib.sha256(f"data{i}".encode()).digest() * (nbytes // 32 + 1))[:nbytes]
