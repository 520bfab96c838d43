from __future__ import annotations

import threading

import pytest
from kv_store_helpers import block, key, small_namespace

from engine.kvstore import block_record
from engine.kvstore.block_store import BlockStore, build_block_store
from engine.kvstore.dram_tier import DramTier
from engine.kvstore.ssd_tier import SsdTier
from engine.kvstore.tier import PutResult, Tier
from engine.pool_spec import parse_pool_spec

NS = small_namespace()
BB = NS.block_bytes
REC = block_record.HEADER_SIZE + BB


class FakeRemote(Tier):
    """A dict standing in for the pool service; S2's real client has its own tests."""

    name = "remote"

    def __init__(self) -> None:
        self.blocks: dict[bytes, bytes] = {}
        self.contains_calls = 0

    def contains(self, k):
        self.contains_calls += 1
        return k in self.blocks

    def get_into(self, k, out):
        if k not in self.blocks:
            return False
        memoryview(out).cast("B")[:] = self.blocks[k]
        return True

    def put(self, k, data, position=0):
        self.blocks[k] = bytes(data)
        return PutResult(True, [])

    def remove(self, k):
        return self.blocks.pop(k, None) is not None

    def clear(self):
        n = len(self.blocks)
        self.blocks.clear()
        return n

    def stats(self):
        return {"blocks": len(self.blocks)}


@pytest.fixture
def store(tmp_path):
    s = BlockStore([DramTier(2 * BB, NS), SsdTier(tmp_path, 10 * REC, NS)], NS)
    yield s
    s.close()


def _get(store, i) -> tuple[str | None, bytes]:
    out = bytearray(BB)
    return store.get_into(key(i), memoryview(out)), bytes(out)


def test_dram_evictions_demote_to_ssd_and_hits_promote_back(store):
    for i in range(4):
        assert store.put(key(i), block(i), position=i)
    dram, ssd = store.tiers
    assert set(dram.keys()) == {key(2), key(3)}
    assert set(ssd.keys()) == {key(0), key(1)}  # demoted, not lost
    assert store.locate([key(i) for i in range(5)]) == ["ssd", "ssd", "dram", "dram"]
    assert store.match([key(0), key(1), key(9), key(2)]) == 2  # a leading run only
    assert _get(store, 0) == ("ssd", block(0))
    assert dram.contains(key(0))  # promoted; key 2 (LRU) went down to the SSD
    assert _get(store, 0) == ("dram", block(0))
    assert _get(store, 2) == ("ssd", block(2))
    assert _get(store, 7) == (None, bytes(BB))
    stats = store.stats()
    assert stats["dram"]["evictions"] >= 3 and stats["ssd"]["hits"] == 2


def test_put_falls_through_to_ssd_when_every_dram_slot_is_leased(store):
    dram, ssd = store.tiers
    for i in range(2):
        store.put(key(i), block(i))
        dram.lease(key(i))
    assert store.put(key(5), block(5)) and ssd.contains(key(5))
    assert not store.put(key(6), b"short")
    for i in range(2):
        dram.release(key(i))


def test_remove_and_clear_cover_every_tier(store):
    for i in range(4):
        store.put(key(i), block(i))
    assert store.remove(key(0)) and not store.contains(key(0))
    assert store.clear() == 3
    assert store.match([key(1)]) == 0


def test_remote_tier_gets_writes_through_and_serves_after_local_misses(tmp_path):
    remote = FakeRemote()
    s = BlockStore([DramTier(2 * BB, NS), remote], NS)
    for i in range(3):
        s.put(key(i), block(i))
    assert set(remote.blocks) == {key(0), key(1), key(2)}
    assert s.locate([key(0), key(1), key(2)]) == ["remote", "dram", "dram"]
    remote.blocks[key(5)] = block(5)  # put by another engine
    assert s.match([key(0), key(1), key(2), key(5), key(6)]) == 4
    calls = remote.contains_calls
    assert s.match([key(1), key(2), key(6)]) == 2 and remote.contains_calls == calls + 1
    assert _get(s, 5) == ("remote", block(5))
    assert s.tiers[0].contains(key(5))  # promoted into DRAM
    s.close()


def test_bad_tier_lists_are_refused():
    with pytest.raises(ValueError, match="remote"):
        BlockStore([FakeRemote(), _Named(FakeRemote(), "remote2")], NS)
    with pytest.raises(ValueError, match="distinct"):
        BlockStore([FakeRemote(), FakeRemote()], NS)


def _Named(tier, name):
    tier.name = name
    return tier


def test_build_from_a_pool_string(tmp_path):
    spec = parse_pool_spec(f"dram={2 * BB},ssd={tmp_path}/kv:1MiB,policy=lfu")
    s = build_block_store(spec, NS)
    assert [t.name for t in s.tiers] == ["dram", "ssd"]
    assert s.tiers[1].dir.parent == tmp_path / "kv"
    assert s.tiers[0]._policy.name == "lfu"
    s.close()


def test_ssd_only_store_survives_a_restart(tmp_path):
    spec = parse_pool_spec(f"ssd={tmp_path}:1MiB")
    s = build_block_store(spec, NS)
    s.put(key(1), block(1))
    s.close()
    s = build_block_store(spec, NS)
    assert _get(s, 1) == ("ssd", block(1))
    s.close()


def test_threads_share_the_store_without_torn_blocks(store):
    errors = []

    def worker(seed: int) -> None:
        for n in range(150):
            i = (seed * 5 + n) % 7
            store.put(key(i), block(i), position=i)
            tier, data = _get(store, i)
            if tier is not None and data != block(i):
                errors.append((tier, i))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for i in range(7):  # every block still readable from some tier, and intact
        tier, data = _get(store, i)
        assert tier is not None and data == block(i)
