"""Chained block hashes: a full block is named by sha256(parent hash, its tokens, extra keys).

The chain makes a block's name depend on its whole prefix, so equal names mean equal prefixes (a
hit is still confirmed by comparing tokens). The root is a fixed constant, not a per-process seed,
so names agree across processes and restarts: the tiered pool and other instances share them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

import msgpack

ROOT_HASH = hashlib.sha256(b"engine-kv-root-v1").digest()


def hash_block(parent: bytes | None, tokens: Sequence[int], extra_keys: tuple = ()) -> bytes:
    h = hashlib.sha256(parent if parent is not None else ROOT_HASH)
    h.update(array("q", tokens).tobytes())
    if extra_keys:
        h.update(msgpack.packb(list(extra_keys)))
    return h.digest()


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple = (),
    parent: bytes | None = None,
    start_block: int = 0,
) -> list[bytes]:
    """Hashes of the full blocks of token_ids from ``start_block`` on; ``parent`` is the hash of
    block ``start_block - 1`` (None at the start). Extra keys (e.g. a cache salt) go into every
    block so that salted and unsalted chains never meet."""
    out: list[bytes] = []
    for b in range(start_block, len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[b * block_size : (b + 1) * block_size], extra_keys)
        out.append(parent)
    return out
