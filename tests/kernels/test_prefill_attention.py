"""Chunked-prefill attention over the paged cache: Triton launcher vs the torch reference, and the
reference vs a naive per-token loop."""

from __future__ import annotations

import pytest
import torch
from paged_inputs import TOL, random_paged_cache

from engine.kernels.prefill_attention import (
    prefill_attention_ref,
    prefill_attention_triton,
    prefill_config,
)


def make_batch(q_lens, contexts, heads, kv_heads, head_dim, block_size, dtype, seed=0):
    """Random paged inputs: each sequence's blocks are a random permutation of the pool, table
    rows padded with -1 past the sequence, the chunk's own K/V already in the cache."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(q_lens, contexts, strict=True)]
    k_cache, v_cache, block_tables = random_paged_cache(
        seq_lens, kv_heads, head_dim, block_size, dtype, g
    )
    q = torch.randn(sum(q_lens), heads, head_dim, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, cu, torch.tensor(seq_lens, dtype=torch.int32)


def check(q_lens, contexts, heads, kv_heads, head_dim, block_size, dtype, **kw):
    q, k_cache, v_cache, bt, cu, seq_lens = make_batch(
        q_lens, contexts, heads, kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    res = prefill_attention_triton(q, k_cache, v_cache, bt, cu, seq_lens, scale, out=out, **kw)
    assert res is out
    assert not out.isnan().any(), "some output elements were not written"
    ref = prefill_attention_ref(q, k_cache, v_cache, bt, cu, seq_lens, scale)
    torch.testing.assert_close(out, ref, **TOL[dtype])


# (q_lens, contexts): mixed = decode + chunk starting mid-block + fresh prefill in one call.
MIXED = ([1, 37, 20], [45, 13, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_default_model_mixed_batch(block_size, dtype):
    # SmolLM2-135M: 9 query heads, 3 KV heads (group 3, not a power of 2), head_dim 64.
    check(*MIXED, 9, 3, 64, block_size, dtype)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,dtype",
    [
        (4, 4, 128, 32, torch.float32),  # group 1
        (8, 2, 64, 64, torch.float16),  # group 4
        (6, 2, 80, 16, torch.float32),  # head_dim 80 padded to 128
        (12, 4, 96, 32, torch.bfloat16),  # head_dim 96
        (4, 1, 128, 16, torch.bfloat16),  # group 4, one KV head
    ],
)
def test_shapes(heads, kv_heads, head_dim, block_size, dtype):
    check([3, 50, 17], [70, 0, 30], heads, kv_heads, head_dim, block_size, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_only_uses_small_tile(dtype):
    # q_len 1 everywhere with the hint: the 16-row tile path.
    assert prefill_config(1, 3, 64, dtype).block_m == 16
    check([1, 1, 1, 1], [1, 16, 33, 90], 9, 3, 64, 16, dtype, max_seqlen_q=1)


def test_configs_per_architecture():
    """What `profiling/kernels.py --aot 90 80` showed spill-free (it fails CI on a spill): sm_90
    runs the 16-row tiles unpipelined; sm_80 takes 32 keys at a time for 64-row tiles of 128-wide
    heads and pipelines fp32. The interpreter (no capability) uses sm_90's."""
    hopper, ampere = (9, 0), (8, 0)
    assert prefill_config(1, 3, 64, torch.bfloat16, hopper).num_stages == 1
    assert prefill_config(100, 1, 128, torch.bfloat16, hopper)[:3] == (64, 64, 64)
    assert prefill_config(100, 1, 128, torch.bfloat16, ampere)[:3] == (64, 64, 32)
    assert prefill_config(100, 1, 128, torch.bfloat16, ampere).num_stages == 2
    assert prefill_config(1, 3, 64, torch.float32, hopper).num_stages == 1
    assert prefill_config(1, 3, 64, torch.float32, ampere).num_stages == 2
    fp32 = (1, 3, 64, torch.float32)
    assert prefill_config(*fp32) == prefill_config(*fp32, hopper)


def test_long_chunk_uses_large_tile():
    assert prefill_config(150, 1, 128, torch.float16).block_m == 128
    check([150, 9], [21, 64], 4, 4, 128, 16, torch.float16, max_seqlen_q=150)


def test_chunks_with_empty_sequence_and_single_tokens():
    # A zero-length chunk, chunks ending exactly on block boundaries, q_len 1 with a long context.
    check([0, 16, 1, 2], [5, 16, 100, 0], 9, 3, 64, 16, torch.float32)


def test_strided_q_and_out_views():
    q, k_cache, v_cache, bt, cu, seq_lens = make_batch(*MIXED, 9, 3, 64, 16, torch.float16)
    fused = torch.randn(q.shape[0], 15, 64).to(torch.float16)  # q, k, v heads of a QKV matmul
    fused[:, :9] = q
    big_out = torch.full((q.shape[0] + 4, 9, 64), float("nan"), dtype=torch.float16)
    out = big_out[4:]
    prefill_attention_triton(fused[:, :9], k_cache, v_cache, bt, cu, seq_lens, 0.125, out=out)
    ref = prefill_attention_ref(q, k_cache, v_cache, bt, cu, seq_lens, 0.125)
    torch.testing.assert_close(out, ref, **TOL[torch.float16])
    assert big_out[:4].isnan().all()


def naive_attention(q, k_cache, v_cache, block_tables, cu, seq_lens, scale):
    """One query token and head at a time, reading the cache through the block table."""
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(len(seq_lens)):
        start, end, kv_len = int(cu[b]), int(cu[b + 1]), int(seq_lens[b])
        for i in range(end - start):
            pos = kv_len - (end - start) + i
            for h in range(q.shape[1]):
                keys = range(pos + 1)
                slots = [(int(block_tables[b, j // block_size]), j % block_size) for j in keys]
                k = torch.stack([k_cache[blk, off, h // group] for blk, off in slots]).double()
                v = torch.stack([v_cache[blk, off, h // group] for blk, off in slots]).double()
                w = torch.softmax(k @ q[start + i, h].double() * scale, dim=0)
                out[start + i, h] = w @ v
    return out


def test_reference_matches_naive_loop():
    q, k_cache, v_cache, bt, cu, seq_lens = make_batch(
        [1, 5, 3], [6, 2, 0], 4, 2, 16, 4, torch.float32
    )
    ref = prefill_attention_ref(q, k_cache, v_cache, bt, cu, seq_lens, 0.3)
    naive = naive_attention(q, k_cache, v_cache, bt, cu, seq_lens, 0.3)
    torch.testing.assert_close(ref.double(), naive, rtol=1e-5, atol=1e-5)


def dense_attention(q, k_cache, v_cache, block_tables, cu, seq_lens, scale):
    """Whole sequences at once in float64: each sequence's K/V gathered through its table row,
    an explicit causal mask, softmax, weighted sum."""
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(len(seq_lens)):
        start, end, kv_len = int(cu[b]), int(cu[b + 1]), int(seq_lens[b])
        pos = torch.arange(kv_len)
        blocks = block_tables[b, pos // block_size].long()
        k = k_cache[blocks, pos % block_size].double().repeat_interleave(group, dim=1)
        v = v_cache[blocks, pos % block_size].double().repeat_interleave(group, dim=1)
        qb = q[start:end].double()  # [n, H, D]
        s = torch.einsum("nhd,khd->hnk", qb, k) * scale
        q_pos = torch.arange(kv_len - (end - start), kv_len)
        s.masked_fill_(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[start:end] = torch.einsum("hnk,khd->nhd", torch.softmax(s, dim=-1), v)
    return out


@pytest.mark.parametrize("block_size", [16, 64])
def test_reference_matches_dense_math_on_long_chunks(block_size):
    # Chunks longer than the reference's 64-row passes, fresh and after a cached prefix, with
    # the default model's heads, and a short one beside them.
    q, k_cache, v_cache, bt, cu, seq_lens = make_batch(
        [150, 70, 3, 200], [0, 300, 10, 129], 9, 3, 64, block_size, torch.float32
    )
    ref = prefill_attention_ref(q, k_cache, v_cache, bt, cu, seq_lens, 0.125)
    dense = dense_attention(q, k_cache, v_cache, bt, cu, seq_lens, 0.125)
    torch.testing.assert_close(ref.double(), dense, rtol=1e-5, atol=1e-5)


def test_rejects_bad_input():
    q, k_cache, v_cache, bt, cu, seq_lens = make_batch(*MIXED, 9, 3, 64, 16, torch.float32)
    args = [q, k_cache, v_cache, bt, cu, seq_lens, 0.125]

    def call(i, value, name):
        bad = list(args)
        bad[i] = value
        with pytest.raises(ValueError, match=name):
            prefill_attention_triton(*bad)

    call(1, k_cache.to(torch.int32), "k_cache")  # no KV dtype (a float of another dtype is one)
    call(0, q.int(), "q")
    call(0, q[:, :8], "heads")  # 8 query heads over 3 KV heads
    call(1, k_cache[..., :32], "k_cache")
    call(2, v_cache[:-1], "v_cache")
    call(3, bt.float(), "block_tables")
    call(3, bt[:2], "block_tables")
    call(4, cu[:-1], "cu_seqlens_q")
    call(4, cu.float(), "cu_seqlens_q")
    call(5, seq_lens[:, None], "seq_lens")
    with pytest.raises(ValueError, match="out"):
        prefill_attention_triton(*args, out=torch.empty_like(q)[:-1])
    with pytest.raises(ValueError, match="out"):
        prefill_attention_triton(*args, out=torch.empty_like(q).half())


@pytest.mark.parametrize("seed", range(6))
def test_random_batches(seed):
    """Random mixes of decode tokens, mid-sequence chunks and fresh prompts over random shapes."""
    g = torch.Generator().manual_seed(100 + seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    kv_heads, group = pick([1, 2, 3]), pick([1, 3, 4])
    head_dim, block_size = pick([64, 80, 128]), pick([8, 16, 32, 64, 128])
    dtype = pick([torch.float32, torch.float16, torch.bfloat16])
    batch = int(torch.randint(1, 5, (1,), generator=g))
    q_lens = [pick([1, 1, 2, 7, 33, 70]) for _ in range(batch)]
    contexts = [int(torch.randint(0, 150, (1,), generator=g)) for _ in range(batch)]
    check(q_lens, contexts, kv_heads * group, kv_heads, head_dim, block_size, dtype)
