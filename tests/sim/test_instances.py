"""The simulated instances' prefix cache (engine/sim/instances.py): what a prefill finds cached,
and what storing a prompt's blocks evicts, as the Conductor is told it."""

from __future__ import annotations

from engine.sim.instances import SimCache


def test_match_counts_the_cached_prefix_only():
    cache = SimCache(8, "lru")
    cache.insert([1, 2, 4], pinned=set())
    assert cache.match([1, 2, 3, 4]) == 2  # block 4 is held, but past a missing one
    assert cache.match([3, 1]) == 0
    assert cache.match([]) == 0


def test_insert_evicts_by_the_policy_but_never_a_pinned_block():
    cache = SimCache(3, "lru")
    assert cache.insert([1, 2, 3], pinned=set()) == ([1, 2, 3], [])
    cache.touch([1])  # 2 is now the least recently used
    assert cache.insert([1, 4], pinned={1, 4}) == ([4], [2])  # 1 refreshed, not new
    # Every block held is pinned: the prompt's blocks past the room are not stored.
    assert cache.insert([5, 6], pinned={1, 3, 4, 5, 6}) == ([], [])
    assert cache.match([1]) == 1 and cache.match([3]) == 1 and cache.match([4]) == 1
    assert cache.insert([5, 6], pinned={5, 6}) == ([5, 6], [3, 1])


def test_a_cache_of_no_blocks_stores_nothing():
    cache = SimCache(0, "lru")
    assert cache.insert([1, 2], pinned=set()) == ([], [])
    assert cache.match([1]) == 0
