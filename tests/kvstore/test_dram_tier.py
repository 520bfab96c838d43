from __future__ import annotations

import os
import subprocess
import sys
import threading
from multiprocessing import shared_memory

import pytest
from kv_store_helpers import block, key, small_namespace

from engine.kvstore.dram_tier import SHM_PREFIX, DramTier

NS = small_namespace()
BB = NS.block_bytes


@pytest.fixture
def tier():
    t = DramTier(4 * BB + 10, NS)  # 4 slots; the remainder is not a slot
    yield t
    t.close()


def _get(t, i) -> bytes | None:
    out = bytearray(BB)
    return bytes(out) if t.get_into(key(i), memoryview(out)) else None


def test_put_get_and_stats(tier):
    assert tier.num_slots == 4 and tier.shm_name.startswith(SHM_PREFIX)
    assert tier.put(key(1), block(1)).stored
    assert _get(tier, 1) == block(1)
    assert _get(tier, 2) is None
    s = tier.stats()
    assert (s["blocks"], s["capacity_blocks"], s["hits"], s["misses"]) == (1, 4, 1, 1)
    assert s["bytes_read"] == BB and s["bytes_written"] == BB


def test_wrong_size_is_a_failed_write_and_bad_out_raises(tier):
    assert not tier.put(key(1), b"short").stored
    assert tier.stats()["failed_writes"] == 1
    tier.put(key(1), block(1))
    with pytest.raises(ValueError, match="bytes"):
        tier.get_into(key(1), memoryview(bytearray(10)))


def test_full_arena_evicts_lru_and_hands_victims_over_before_reuse(tier):
    seen = []
    tier.on_evict = lambda k, view: seen.append((k, bytes(view)))
    for i in range(4):
        tier.put(key(i), block(i))
    _get(tier, 0)  # 0 is now the most recent
    result = tier.put(key(4), block(4))
    assert result.stored and result.evicted == [key(1)]
    assert seen == [(key(1), block(1))]  # the victim's bytes, read before its slot was reused
    assert _get(tier, 1) is None and _get(tier, 4) == block(4) and _get(tier, 0) == block(0)
    assert tier.stats()["evictions"] == 1


def test_leased_block_is_not_evicted_and_removal_waits_for_release(tier):
    for i in range(4):
        tier.put(key(i), block(i))
    offset = tier.lease(key(0))  # the LRU victim-to-be
    assert offset is not None
    assert tier.put(key(4), block(4)).evicted == [key(1)]
    assert tier.remove(key(0))  # removed from the index, slot kept while leased
    assert not tier.contains(key(0))
    assert bytes(tier.slot_view(offset)) == block(0)
    for i in range(5, 8):
        tier.put(key(i), block(i))
    assert bytes(tier.slot_view(offset)) == block(0)  # not reused while leased
    assert not tier.put(key(0), block(0)).stored  # re-put waits for the lease to end
    tier.release(key(0))
    assert tier.put(key(0), block(0)).stored


def test_all_slots_pinned_is_a_failed_put_not_an_exception(tier):
    for i in range(4):
        tier.put(key(i), block(i))
        tier.lease(key(i))
    assert tier.put(key(9), block(9)) == (False, [])
    assert tier.stats()["failed_writes"] == 1


def test_two_phase_put_is_invisible_until_commit(tier):
    offset = tier.reserve(key(1))
    assert offset is not None and tier.reserve(key(1)) is None
    tier.slot_view(offset)[:] = block(1)
    assert not tier.contains(key(1)) and _get(tier, 1) is None
    assert tier.commit(key(1)) and _get(tier, 1) == block(1)
    offset = tier.reserve(key(2))
    tier.abort(key(2))
    assert not tier.commit(key(2)) and not tier.contains(key(2))
    assert tier.stats()["reserved"] == 0


def test_another_process_reads_the_arena_by_name_and_offset(tier):
    tier.put(key(3), block(3))
    offset = tier.lease(key(3))
    other = shared_memory.SharedMemory(name=tier.shm_name)  # as a pool client would map it
    try:
        assert bytes(other.buf[offset : offset + BB]) == block(3)
    finally:
        other.close()
        tier.release(key(3))


def test_close_unlinks_the_segment():
    t = DramTier(2 * BB, NS)
    name = t.shm_name
    assert os.path.exists(f"/dev/shm/{name}")
    t.close()
    t.close()  # idempotent
    assert not os.path.exists(f"/dev/shm/{name}")


def test_clear_and_remove(tier):
    for i in range(3):
        tier.put(key(i), block(i))
    assert tier.remove(key(0)) and not tier.remove(key(0))
    assert tier.clear() == 2 and tier.stats()["blocks"] == 0
    for i in range(4):  # every slot is free again
        assert tier.put(key(10 + i), block(10 + i)).evicted == []


def test_threads_never_see_torn_blocks(tier):
    errors = []

    def worker(seed: int) -> None:
        for n in range(300):
            i = (seed * 7 + n) % 9
            tier.put(key(i), block(i))
            got = _get(tier, i)
            if got is not None and got != block(i):
                errors.append(i)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = tier.stats()
    assert s["blocks"] <= 4 and s["pinned"] == 0 and s["reserved"] == 0


def test_a_new_arena_removes_those_of_dead_owners_only():
    """A SIGKILLed owner cannot unlink its arena; the next tier created on the host does."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = f"{SHM_PREFIX}{dead.pid}-0123456789abcdef"
    live = f"{SHM_PREFIX}{os.getpid()}-fedcba9876543210"
    foreign = f"{SHM_PREFIX}notapid"
    for name in (orphan, live, foreign):
        with open(f"/dev/shm/{name}", "wb") as f:
            f.write(b"x")
    try:
        t = DramTier(4 * small_namespace().block_bytes, small_namespace())
        try:
            assert t.shm_name.startswith(f"{SHM_PREFIX}{os.getpid()}-")
            assert not os.path.exists(f"/dev/shm/{orphan}")
            assert os.path.exists(f"/dev/shm/{live}")
            assert os.path.exists(f"/dev/shm/{foreign}")
        finally:
            t.close()
    finally:
        for name in (orphan, live, foreign):
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")


def test_a_slot_rewritten_after_its_commit_reads_as_a_miss(tier):
    """A client whose reservation ended while it stalled, writing through its mapping anyway,
    lands in a slot that now holds another block: the block's checksum, taken at commit, makes
    every later read of it a miss instead of the other bytes."""
    assert tier.put(key(1), memoryview(block(1, BB))).stored
    offset = tier.slot_offset(key(1))
    tier.slot_view(offset)[:] = block(2, BB)  # the stalled writer's late copy
    out = bytearray(BB)
    assert not tier.get_into(key(1), memoryview(out))
    assert tier.stats()["failed_reads"] == 1


def test_commit_refuses_a_slot_that_does_not_hold_what_its_writer_hashed(tier):
    from engine.kvstore.block_record import checksum

    offset = tier.reserve(key(3))
    tier.slot_view(offset)[:] = block(3, BB)
    assert not tier.commit(key(3), checksum(block(4, BB)))  # a torn or clobbered write
    assert not tier.contains(key(3))
    offset = tier.reserve(key(3))  # the slot went back: the write can be tried again
    tier.slot_view(offset)[:] = block(3, BB)
    assert tier.commit(key(3), checksum(block(3, BB)))
    assert _get(tier, 3) == block(3, BB)
