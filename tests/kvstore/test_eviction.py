from __future__ import annotations

import pytest

from engine.kvstore.eviction import POLICIES, make_policy


def _drain(policy, skip=frozenset()) -> list:
    out = []
    while (key := policy.victim(skip)) is not None:
        out.append(key)
        policy.on_remove(key)
    return out


def test_lru_order_follows_last_use():
    p = make_policy("lru")
    for k in "abcd":
        p.on_insert(k)
    p.on_access("a")
    p.on_insert("c")  # re-insert of a present key refreshes it
    assert _drain(p) == ["b", "d", "a", "c"]


def test_lfu_evicts_least_frequent_then_least_recent():
    p = make_policy("lfu")
    for k in "abcd":
        p.on_insert(k)
    for k in "aaab":
        p.on_access(k)
    p.on_access("d")  # d: 2 uses, b: 2 uses, but b was used earlier
    assert _drain(p) == ["c", "b", "d", "a"]


def test_length_aware_evicts_later_blocks_first_among_equals():
    p = make_policy("length")
    # One request's chain: blocks 0..3; then a second request shares blocks 0 and 1.
    for pos, k in enumerate("abcd"):
        p.on_insert(k, position=pos)
    p.on_access("a")
    p.on_access("b")
    p.on_insert("x", position=2)
    # Frequency first (c, d, x once; a, b twice); among equals the later position first,
    # then the least recent.
    assert _drain(p) == ["d", "c", "x", "b", "a"]


def test_lru_forgets_frequency_lfu_and_length_do_not():
    victims = {}
    for name in POLICIES:
        p = make_policy(name)
        p.on_insert("a", 0)
        p.on_insert("b", 1)
        p.on_access("a")
        p.on_access("a")
        p.on_access("b")  # b most recent, a most frequent
        victims[name] = p.victim()
    assert victims == {"lru": "a", "lfu": "b", "length": "b"}


@pytest.mark.parametrize("name", POLICIES)
def test_skip_pinned_and_all_pinned(name):
    p = make_policy(name)
    for k in "abc":
        p.on_insert(k)
    assert p.victim(skip={"a"}) == "b"
    assert p.victim(skip={"a", "b", "c"}) is None
    assert p.victim() == "a"  # skipping did not lose entries
    assert len(p) == 3 and "a" in p


@pytest.mark.parametrize("name", POLICIES)
def test_remove_unknown_and_clear(name):
    p = make_policy(name)
    p.on_remove("nope")
    p.on_access("nope")
    assert len(p) == 0 and p.victim() is None
    p.on_insert(1)
    p.on_insert(2)
    p.on_remove(1)
    assert p.victim() == 2
    p.clear()
    assert p.victim() is None and len(p) == 0


@pytest.mark.parametrize("name", ["lfu", "length"])
def test_heap_stays_bounded_under_many_accesses(name):
    p = make_policy(name)
    for k in range(10):
        p.on_insert(k)
    for i in range(10_000):
        p.on_access(i % 10)
    assert len(p._heap) <= 2 * len(p) + 65
    assert sorted(_drain(p)) == list(range(10))


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="lru"):
        make_policy("fifo")
