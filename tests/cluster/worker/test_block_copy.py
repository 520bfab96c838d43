"""Block copies between prefill workers (engine/cluster/worker/block_copy.py): the KV of named
blocks moves from one paged cache to another and is found there by its chained hashes; a bad copy
(size, checksum, tokens) is refused and leaves the target untouched; copies of blocks already
held or beyond the free room store what they can; the copier's two ends over real sockets; and
on the real model, a prefix stored by a copy is served from the cache with the same greedy
output as computing it."""

from __future__ import annotations

import time
import zlib
from types import SimpleNamespace

import pytest
import torch
import zmq

from engine.cluster import messages as m
from engine.cluster.worker.block_copy import (
    BlockCopier,
    cached_blocks,
    gather_blocks,
    store_blocks,
)
from engine.kvcache.block_pool import BlockPool
from engine.kvcache.prefix_hash import hash_blocks

BS = 4
TOKENS = list(range(100, 100 + 5 * BS))  # 5 full blocks


def fake_engine(num_blocks: int = 16, seed: int = 0) -> SimpleNamespace:
    """What the copy touches of an engine: the block pool and the paged cache tensor."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(3, 2, num_blocks, BS, 2, 4, generator=g)
    return SimpleNamespace(
        kv=SimpleNamespace(block_size=BS, pool=BlockPool(num_blocks)),
        cache=SimpleNamespace(kv=kv),
    )


def hold(engine, tokens: list[int]) -> list[int]:
    """Name blocks for the whole blocks of tokens, as a finished prefill leaves them."""
    pool = engine.kv.pool
    hashes = hash_blocks(tokens, BS)
    blocks = pool.allocate(len(hashes))
    for i, (b, h) in enumerate(zip(blocks, hashes)):
        pool.cache(b, h, tokens[i * BS : (i + 1) * BS])
    pool.free(reversed(blocks))
    return blocks


def test_copied_blocks_are_found_by_hash_with_the_sources_kv():
    src, dst = fake_engine(seed=1), fake_engine(seed=2)
    blocks = hold(src, TOKENS)
    hold(dst, TOKENS[: 2 * BS])  # the target holds the first two blocks already
    got = gather_blocks(src, TOKENS, 2)
    assert got.num_blocks == 3
    n = store_blocks(dst, TOKENS, 2, got.num_blocks, got.data, zlib.crc32(got.data))
    assert n == 3
    held = cached_blocks(dst, TOKENS)
    assert len(held) == 5  # the whole chain now matches on the target
    for i in range(2, 5):
        torch.testing.assert_close(dst.cache.kv[:, :, held[i]], src.cache.kv[:, :, blocks[i]])
    dst.kv.pool.check_integrity()
    assert dst.kv.pool.counts().used == 0  # cached, not held: evictable like any other block


def test_source_sends_only_the_run_it_still_holds():
    src = fake_engine()
    hold(src, TOKENS[: 3 * BS])
    assert gather_blocks(src, TOKENS, 1).num_blocks == 2
    assert gather_blocks(src, TOKENS, 3) == (0, b"")
    assert gather_blocks(fake_engine(), TOKENS, 0) == (0, b"")


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(checksum=1), "checksum"),
        (dict(data=b"\x00" * 10), "bytes"),
        (dict(token_ids=TOKENS[:-1]), "token_ids"),
        (dict(start_block=-1), "start_block"),
    ],
)
def test_a_bad_copy_is_refused_and_changes_nothing(change, words):
    src, dst = fake_engine(seed=1), fake_engine(seed=2)
    hold(src, TOKENS)
    got = gather_blocks(src, TOKENS, 0)
    args = dict(
        token_ids=TOKENS, start_block=0, num_blocks=5, data=got.data, checksum=zlib.crc32(got.data)
    )
    args.update(change)
    before = dst.cache.kv.clone()
    with pytest.raises(ValueError, match=words):
        store_blocks(dst, **args)
    assert cached_blocks(dst, TOKENS) == []
    assert torch.equal(dst.cache.kv, before)
    dst.kv.pool.check_integrity()


def test_no_free_room_stores_the_head_of_the_chain_only():
    src, dst = fake_engine(), fake_engine(num_blocks=4)
    hold(src, TOKENS)
    running = dst.kv.pool.allocate(2)  # a running request holds two of the four blocks
    got = gather_blocks(src, TOKENS, 0)
    assert store_blocks(dst, TOKENS, 0, 5, got.data, zlib.crc32(got.data)) == 2
    assert len(cached_blocks(dst, TOKENS)) == 2
    assert all(dst.kv.pool.ref_cnt[b] == 1 for b in running)  # never taken from a request
    dst.kv.pool.check_integrity()


def test_copier_ends_over_sockets_report_copy_done():
    ctx = zmq.Context.instance()
    src, dst = fake_engine(seed=1), fake_engine(seed=2)
    hold(src, TOKENS)
    sent, done = [], []
    a = BlockCopier(src, "p0", sent.append, ctx)
    b = BlockCopier(dst, "p1", done.append, ctx)
    try:
        a.send(m.CopyBlocks("r1/0", TOKENS + [7], 1, b.address))  # a partial block is ignored
        a.send(m.CopyBlocks("r2/0", list(range(900, 900 + 2 * BS)), 0, b.address))  # not held
        deadline = time.monotonic() + 10
        while len(done) < 2:
            assert time.monotonic() < deadline, "no copy arrived"
            b.take()
            time.sleep(0.01)
    finally:
        a.close()
        b.close()
    assert sent == []  # the source tells the router nothing; the target does
    assert done[0] == m.CopyDone("r1/0", "p1", 4)
    assert done[1].blocks == 0 and "holds none" in done[1].error
    hashes = hash_blocks(TOKENS, BS)
    named = [dst.kv.pool.lookup(h, TOKENS[i * BS : (i + 1) * BS]) for i, h in enumerate(hashes)]
    assert named[0] is None and None not in named[1:]  # blocks 1..4, as asked
    assert cached_blocks(dst, TOKENS) == []  # without block 0 no prefix match starts


def test_real_model_serves_a_copied_prefix_from_its_cache_with_the_same_output():
    from engine import LLM, SamplingParams

    llm = LLM("default", dtype="float32", device="cpu", num_blocks=64)
    engine = llm.engine
    prompt = list(range(2000, 2000 + 100))  # 6 full blocks of 16
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    try:
        first = llm.generate(prompt, greedy)[0]
        assert first.metrics.num_cached_tokens == 0
        got = gather_blocks(engine, prompt[:96], 0)
        assert got.num_blocks == 6
        # Forget every cached block and wipe the cache: only the copy can bring the prefix back.
        llm.reset_prefix_cache()
        engine.cache.kv.zero_()
        assert cached_blocks(engine, prompt[:96]) == []
        assert store_blocks(engine, prompt[:96], 0, 6, got.data, zlib.crc32(got.data)) == 6
        again = llm.generate(prompt, greedy)[0]
        assert again.metrics.num_cached_tokens == 96
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
    finally:
        llm.close()
