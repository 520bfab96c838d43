import pytest

from engine.kvcache.block_pool import BlockPool
from engine.kvcache.prefix_hash import hash_block, hash_blocks


def test_allocate_free_counts_and_lru_reuse():
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert pool.check_integrity() == (2, 0, 2, 4)
    pool.cache(a[0], b"h0", (1, 2))
    pool.free(reversed(a))  # tail first
    counts = pool.check_integrity()
    assert counts.free == 3 and counts.cached == 1 and counts.used == 0
    # Never-used blocks first, then the freed tail, then the cached head: the prefix lives longest.
    order = pool.allocate(4)
    assert order[-2:] == [a[1], a[0]]
    assert pool.lookup(b"h0", (1, 2)) is None  # reusing the block dropped its name
    pool.check_integrity()


def test_lookup_confirms_tokens_and_touch_revives():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.cache(b, b"h", (5, 6))
    pool.free([b])
    assert pool.lookup(b"h", (5, 7)) is None  # same name, different tokens: not a hit
    assert pool.lookup(b"h", (5, 6)) == b
    pool.touch([b])
    assert pool.ref_cnt[b] == 1 and pool.num_free == 2
    pool.touch([b])
    pool.free([b, b])
    assert pool.check_integrity().cached == 1


def test_double_free_and_overallocation_raise():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError):
        pool.free([b])
    with pytest.raises(MemoryError):
        pool.allocate(3)


def test_hash_chain_depends_on_prefix_and_salt():
    a = hash_blocks(list(range(48)), 16)
    assert len(a) == 3
    b = hash_blocks([99] + list(range(1, 48)), 16)
    assert all(x != y for x, y in zip(a, b))  # a change in block 0 renames every later block
    salted = hash_blocks(list(range(48)), 16, extra_keys=("tenant-a",))
    assert not set(salted) & set(a)
    # Incremental extension equals hashing from scratch.
    assert hash_blocks(list(range(48)), 16, parent=a[0], start_block=1) == a[1:]
    assert hash_block(None, range(16)) == a[0]


def test_listener_hears_names_and_evictions():
    heard = []
    pool = BlockPool(2, listener=lambda kind, h: heard.append((kind, h)))
    a, b = pool.allocate(2)
    pool.cache(a, b"h-a", [1, 2])
    pool.cache(b, b"h-a", [1, 2])  # the name is taken: nothing new to report
    pool.free([b, a])
    pool.allocate(1)  # reuses b (freed first, unnamed): no eviction
    pool.allocate(1)  # reuses a: its name is evicted
    assert heard == [("stored", b"h-a"), ("removed", b"h-a")]
    pool.check_integrity()
