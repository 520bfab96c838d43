"""Split-KV paged decode attention: Triton launcher vs the torch reference, the reference vs a
naive per-token loop, and the split-count heuristic."""

from __future__ import annotations

import pytest
import torch
from paged_inputs import TOL, random_paged_cache

from engine.kernels.decode_attention import (
    MAX_SPLITS,
    choose_num_splits,
    decode_attention_ref,
    decode_attention_triton,
)


def make_batch(seq_lens, heads, kv_heads, head_dim, block_size, dtype, seed=0):
    """Random paged inputs: blocks a random permutation of the pool, table rows padded with -1."""
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables = random_paged_cache(
        seq_lens, kv_heads, head_dim, block_size, dtype, g
    )
    q = torch.randn(len(seq_lens), heads, head_dim, generator=g).to(dtype)
    return q, k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32)


def check(seq_lens, heads, kv_heads, head_dim, block_size, dtype, **kw):
    q, k_cache, v_cache, bt, lens = make_batch(
        seq_lens, heads, kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    assert decode_attention_triton(q, k_cache, v_cache, bt, lens, scale, out=out, **kw) is out
    assert not out.isnan().any(), "some output elements were not written"
    ref = decode_attention_ref(q, k_cache, v_cache, bt, lens, scale)
    torch.testing.assert_close(out, ref, **TOL[dtype])


RAGGED = [1, 17, 100, 257]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_default_model(num_splits, dtype):
    # SmolLM2-135M: 9 query heads over 3 KV heads, head_dim 64; ragged lengths, one of 1 token.
    check(RAGGED, 9, 3, 64, 16, dtype, num_splits=num_splits, max_seq_len=257)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,dtype",
    [
        (4, 4, 128, 32, torch.float32),  # group 1
        (8, 2, 64, 64, torch.float16),  # group 4
        (8, 2, 128, 16, torch.bfloat16),
        (6, 2, 80, 32, torch.float32),  # head_dim 80 padded to 128
    ],
)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_shapes(heads, kv_heads, head_dim, block_size, dtype, num_splits):
    check([5, 130, 64, 33], heads, kv_heads, head_dim, block_size, dtype, num_splits=num_splits)


@pytest.mark.slow  # CI time on a 2-core Zen 3 EPYC: `pytest -m slow`
def test_many_empty_splits():
    # 16 splits over sequences of 1..40 tokens: most splits have no work and must weigh nothing.
    check([1, 2, 40], 9, 3, 64, 16, torch.float32, num_splits=16)
    # A huge hint is clamped (MAX_FORCED_SPLITS), not an error.
    check([3, 200], 4, 1, 64, 16, torch.float16, num_splits=10_000)


@pytest.mark.slow  # CI time on a 2-core Zen 3 EPYC: `pytest -m slow`
def test_fixed_grid_as_under_a_cuda_graph():
    # A CUDA graph freezes the launch: splits sized for max_model_len, the batch padded to its
    # bucket with rows of length 0 (block table rows of zeros), the table as wide as
    # max_model_len. Two different steps through that one launch shape: each real row equals the
    # reference on the real rows alone, each padding row is zeros (no NaN to leak into a layer).
    max_model_len, bucket, block_size = 1024, 8, 16
    width = max_model_len // block_size
    assert choose_num_splits(bucket, 3, max_model_len, 132) == 4
    for seed, lens in ((0, [1, 300, 17]), (1, [40, 2, 129, 900, 5])):
        q, k_cache, v_cache, bt, real = make_batch(lens, 9, 3, 64, block_size, torch.float32, seed)
        n = len(lens)
        table = torch.zeros(bucket, width, dtype=torch.int32)
        table[:n, : bt.shape[1]] = bt.clamp(min=0)
        seq_lens = torch.zeros(bucket, dtype=torch.int32)
        seq_lens[:n] = real
        qp = torch.cat([q, torch.randn(bucket - n, 9, 64)])
        out = torch.full_like(qp, float("nan"))
        decode_attention_triton(
            qp, k_cache, v_cache, table, seq_lens, 0.125, out=out, max_seq_len=max_model_len
        )
        ref = decode_attention_ref(q, k_cache, v_cache, bt, real, 0.125)
        torch.testing.assert_close(out[:n], ref, **TOL[torch.float32])
        assert torch.equal(out[n:], torch.zeros_like(out[n:]))


def test_split_count_from_table_width_without_hint():
    # No max_seq_len: the heuristic sizes splits from the block table width, no host sync.
    check([300, 20], 9, 3, 64, 16, torch.float32)


def test_strided_q_and_out_views():
    q, k_cache, v_cache, bt, lens = make_batch(RAGGED, 9, 3, 64, 16, torch.float16)
    fused = torch.randn(len(RAGGED), 15, 64).to(torch.float16)
    fused[:, :9] = q
    big_out = torch.full((len(RAGGED) + 2, 9, 64), float("nan"), dtype=torch.float16)
    out = big_out[:-2]
    decode_attention_triton(fused[:, :9], k_cache, v_cache, bt, lens, 0.125, out=out, num_splits=2)
    ref = decode_attention_ref(q, k_cache, v_cache, bt, lens, 0.125)
    torch.testing.assert_close(out, ref, **TOL[torch.float16])
    assert big_out[-2:].isnan().all()


def test_choose_num_splits():
    sms = 132
    assert choose_num_splits(256, 8, 32768, sms) == 1  # the batch alone fills the GPU
    assert choose_num_splits(64, 3, 4096, sms) == 1
    assert choose_num_splits(1, 3, 200, sms) == 1  # too short to be worth splitting
    one = choose_num_splits(1, 8, 32768, sms)
    assert 1 < one <= MAX_SPLITS and one * 8 >= sms
    assert choose_num_splits(1, 3, 32768, sms) == MAX_SPLITS
    assert choose_num_splits(16, 3, 1024, sms) == 4  # capped by 256 tokens per split


def naive_decode(q, k_cache, v_cache, block_tables, seq_lens, scale):
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        slots = [(int(block_tables[b, j // block_size]), j % block_size) for j in range(n)]
        for h in range(q.shape[1]):
            k = torch.stack([k_cache[blk, off, h // group] for blk, off in slots]).double()
            v = torch.stack([v_cache[blk, off, h // group] for blk, off in slots]).double()
            out[b, h] = torch.softmax(k @ q[b, h].double() * scale, dim=0) @ v
    return out


@pytest.mark.parametrize(
    "seq_lens, heads, kv_heads, head_dim, block_size",
    [
        ([1, 9, 5], 4, 2, 16, 4),
        # The default model's heads; 1,000 tokens span two of the CPU path's gather chunks
        # (56 blocks each at this batch), and the rows reach different chunks.
        ([1000, 17, 950], 9, 3, 64, 16),
        ([40, 3], 8, 8, 16, 4),  # more KV heads than the chunked path takes
        ([37], 9, 3, 64, 16),  # a lone sequence (its own path up to 1,024 tokens)
        ([1], 9, 3, 64, 16),
        ([1100], 9, 3, 64, 16),  # a lone sequence past that: the chunked path
    ],
)
def test_reference_matches_naive_loop(seq_lens, heads, kv_heads, head_dim, block_size):
    q, k_cache, v_cache, bt, lens = make_batch(
        seq_lens, heads, kv_heads, head_dim, block_size, torch.float32
    )
    ref = decode_attention_ref(q, k_cache, v_cache, bt, lens, 0.3)
    naive = naive_decode(q, k_cache, v_cache, bt, lens, 0.3)
    torch.testing.assert_close(ref.double(), naive, rtol=1e-5, atol=1e-5)


def test_rejects_bad_input():
    q, k_cache, v_cache, bt, lens = make_batch(RAGGED, 9, 3, 64, 16, torch.float32)
    args = [q, k_cache, v_cache, bt, lens, 0.125]

    def call(i, value, name, **kw):
        bad = list(args)
        bad[i] = value
        with pytest.raises(ValueError, match=name):
            decode_attention_triton(*bad, **kw)

    call(1, k_cache.to(torch.int32), "k_cache")  # no KV dtype (a float of another dtype is one)
    call(0, q[:, :, None], "q")
    call(0, q[:, :7], "heads")
    call(1, k_cache[..., :32], "k_cache")
    call(2, v_cache.half(), "v_cache")
    call(3, bt.float(), "block_tables")
    call(3, bt[:1], "block_tables")
    call(4, lens[:-1], "seq_lens")
    call(4, lens.float(), "seq_lens")
    call(5, 0.125, "out", out=torch.empty(4, 9, 32))
    call(5, 0.125, "num_splits", num_splits=0)


@pytest.mark.parametrize("seed", range(6))
def test_random_batches(seed):
    g = torch.Generator().manual_seed(200 + seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=g))]

    kv_heads, group = pick([1, 2, 3]), pick([1, 3, 4])
    head_dim, block_size = pick([64, 80, 128]), pick([8, 16, 32, 64, 128])
    dtype = pick([torch.float32, torch.float16, torch.bfloat16])
    seq_lens = [int(torch.randint(1, 400, (1,), generator=g)) for _ in range(pick([1, 3, 6]))]
    splits = pick([None, 1, 2, 5])
    check(seq_lens, kv_heads * group, kv_heads, head_dim, block_size, dtype, num_splits=splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_split_tokens_make_a_sequence_batch_invariant(dtype):
    # The batch-invariant mode (docs/determinism.md): with split_tokens every split is that many
    # tokens at absolute positions, so a sequence's bits do not follow the batch's longest
    # sequence or size, which the default split count does.
    lens = [300, 40, 1000, 129]
    q, k_cache, v_cache, bt, seq_lens = make_batch(lens, 8, 2, 64, 16, dtype)
    scale = 64**-0.5
    batched = decode_attention_triton(q, k_cache, v_cache, bt, seq_lens, scale, split_tokens=128)
    for i in range(len(lens)):
        alone = decode_attention_triton(
            q[i : i + 1], k_cache, v_cache, bt[i : i + 1], seq_lens[i : i + 1], scale,
            split_tokens=128,
        )  # fmt: skip
        assert torch.equal(alone[0], batched[i]), i
    ref = decode_attention_ref(q, k_cache, v_cache, bt, seq_lens, scale)
    torch.testing.assert_close(batched, ref, **TOL[dtype])
    with pytest.raises(ValueError, match="split_tokens"):
        decode_attention_triton(q, k_cache, v_cache, bt, seq_lens, scale, split_tokens=100)
