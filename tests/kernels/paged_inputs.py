"""Shared by the attention kernel tests: tolerances and random paged caches."""

from __future__ import annotations

import math

import torch

TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=1e-2, atol=1e-2),
    torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
}


def random_paged_cache(seq_lens, kv_heads, head_dim, block_size, dtype, g: torch.Generator):
    """k_cache, v_cache and block tables for sequences of ``seq_lens`` tokens: each sequence's
    blocks are a random permutation of the pool (with spare blocks), table rows padded with -1."""
    blocks_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    width = max(blocks_per_seq) + 2
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        block_tables[b, :n] = perm[used : used + n]
        used += n
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    return k_cache, v_cache, block_tables
