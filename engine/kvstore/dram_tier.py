"""The DRAM tier: one preallocated shared-memory arena cut into fixed slots of one block each.

No Python object per block holds data: the arena is a single ``multiprocessing.shared_memory``
segment (named ``engine-kv-...``, so another process on the host, e.g. a pool service's client,
can map it and copy a block by offset), and the tier keeps only a free list of slots, a key ->
slot index and the eviction policy's order.

Slot states: free (on the free list), reserved (being written: invisible to readers and never
evicted), stored (in the index, evictable unless pinned), doomed (removed while a reader held a
lease; returns to the free list when the last lease is released). A read lease (``lease`` /
``release``) pins a stored slot so it is neither evicted nor reused while someone copies from it;
a write is two-phase (``reserve`` then ``commit`` or ``abort``), so no reader sees a partial block.

Every stored block keeps the checksum of its bytes (block_record.checksum), taken at commit and
checked against the writer's own when it gives one (a client that wrote the slot through its
mapping: a commit whose slot does not hold what the writer hashed is refused). Readers get it
with their lease and check their copy, and ``get_into`` checks its own: a slot written by a
client whose reservation had already ended (stalled past it, then writing anyway) is read as a
miss, never as another block's bytes.

When the arena is full a put evicts by policy; each victim is handed to ``on_evict(key, view)``
under the tier's lock, before its slot is reused, so the store can demote it to the next tier.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from multiprocessing import shared_memory

from engine.ipc.process_id import remove_orphan_files
from engine.kvstore.block_record import checksum as block_checksum
from engine.kvstore.eviction import make_policy
from engine.kvstore.namespace import KVNamespace
from engine.kvstore.tier import LocalTier, PutResult

SHM_PREFIX = "engine-kv-"
_SHM_DIR = "/dev/shm"

logger = logging.getLogger(__name__)

EvictCallback = Callable[[bytes, memoryview], None]


class DramTier(LocalTier):
    name = "dram"

    def __init__(
        self,
        capacity_bytes: int,
        namespace: KVNamespace,
        policy: str = "lru",
        shm_name: str | None = None,
        on_evict: EvictCallback | None = None,
    ) -> None:
        self.namespace = namespace
        self.block_bytes = namespace.block_bytes
        self.num_slots = self.capacity_blocks = capacity_bytes // self.block_bytes
        if self.num_slots < 1:
            raise ValueError(
                f"dram capacity {capacity_bytes} bytes holds no block of {self.block_bytes} bytes"
            )
        self.on_evict = on_evict
        self._policy = make_policy(policy)
        if shm_name is None:
            remove_orphan_arenas()
        self._shm = shared_memory.SharedMemory(
            # The owner's pid in the name lets a later start remove the arena of a killed one.
            name=shm_name or f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:16]}",
            create=True,
            size=self.num_slots * self.block_bytes,
        )
        self._buf = self._shm.buf
        super().__init__()
        self._free = list(range(self.num_slots - 1, -1, -1))  # a stack: slot 0 is taken first
        self._index: dict[bytes, int] = {}
        self._reserved: dict[bytes, tuple[int, int]] = {}  # key -> (slot, position)
        self._pins: dict[bytes, int] = {}
        self._doomed: dict[bytes, int] = {}
        self._sums: dict[bytes, int] = {}  # stored key -> checksum of its bytes
        self._closed = False

    # -- shared-memory addressing, for processes that map the arena ------------------------------

    @property
    def shm_name(self) -> str:
        return self._shm.name

    @property
    def arena_bytes(self) -> int:
        return self.num_slots * self.block_bytes

    def slot_offset(self, key: bytes) -> int | None:
        """The arena offset of a stored block (no lease: the slot may be reused at once)."""
        with self._lock:
            slot = self._index.get(key)
        return None if slot is None else slot * self.block_bytes

    def slot_view(self, offset: int) -> memoryview:
        """A writable view of the slot at ``offset`` (for reserved or leased slots only)."""
        return self._buf[offset : offset + self.block_bytes]

    # -- leases and two-phase writes ---------------------------------------------------------------

    def lease(self, key: bytes) -> int | None:
        """Pin a stored block for reading; its offset, or None on a miss. Counts as a hit and an
        access. Call ``release(key)`` when the copy is done."""
        with self._lock:
            slot = self._index.get(key)
            if slot is None:
                self._counters["misses"] += 1
                return None
            self._pins[key] = self._pins.get(key, 0) + 1
            self._policy.on_access(key)
            self._counters["hits"] += 1
            self._counters["bytes_read"] += self.block_bytes
            return slot * self.block_bytes

    def checksum(self, key: bytes) -> int | None:
        """The checksum of a stored block's bytes (as committed); None if not stored."""
        with self._lock:
            return self._sums.get(key)

    def release(self, key: bytes) -> None:
        with self._lock:
            count = self._pins.get(key, 0) - 1
            if count > 0:
                self._pins[key] = count
                return
            self._pins.pop(key, None)
            slot = self._doomed.pop(key, None)
            if slot is not None:
                self._free.append(slot)

    def reserve(self, key: bytes, position: int = 0) -> int | None:
        """A slot to write key's block into (evicting if full); None if the key is stored or being
        written already, or every slot is pinned or reserved. Then ``commit`` or ``abort``."""
        with self._lock:
            return self._reserve(key, position, [])

    def commit(self, key: bytes, expected: int | None = None) -> bool:
        """Make a reserved block visible. False if it was not reserved (aborted, cleared), or
        if ``expected`` (the writer's checksum of what it wrote) is not what the slot holds:
        the slot is then freed."""
        with self._lock:
            reserved = self._reserved.get(key)
        if reserved is None:
            return False
        offset = reserved[0] * self.block_bytes
        actual = block_checksum(self._buf[offset : offset + self.block_bytes])  # unlocked
        with self._lock:
            if self._reserved.get(key) is not reserved:
                return False  # aborted (its deadline) meanwhile
            del self._reserved[key]
            slot, position = reserved
            if expected is not None and actual != expected:
                self._free.append(slot)
                self._counters["failed_writes"] += 1
                logger.warning("DRAM tier: a slot does not hold what its writer hashed; refused")
                return False
            self._index[key] = slot
            self._sums[key] = actual
            self._policy.on_insert(key, position)
            self._counters["bytes_written"] += self.block_bytes
            return True

    def abort(self, key: bytes) -> None:
        with self._lock:
            reserved = self._reserved.pop(key, None)
            if reserved is not None:
                self._free.append(reserved[0])

    # -- the Tier contract -------------------------------------------------------------------------

    def get_into(self, key: bytes, out: memoryview) -> bool:
        out = memoryview(out).cast("B")
        if out.nbytes != self.block_bytes:
            raise ValueError(f"out has {out.nbytes} bytes, a block has {self.block_bytes}")
        offset = self.lease(key)
        if offset is None:
            return False
        try:
            expected = self.checksum(key)
            out[:] = self._buf[offset : offset + self.block_bytes]  # one memcpy, lock not held
        finally:
            self.release(key)
        if block_checksum(out) != expected:
            with self._lock:
                self._counters["failed_reads"] += 1
            return False
        return True

    def put(self, key: bytes, data: memoryview, position: int = 0) -> PutResult:
        data = memoryview(data).cast("B")
        evicted: list[bytes] = []
        with self._lock:
            if data.nbytes != self.block_bytes:
                self._counters["failed_writes"] += 1
                return PutResult(False, evicted)
            if key in self._index:
                self._policy.on_insert(key, position)
                return PutResult(True, evicted)
            offset = self._reserve(key, position, evicted)
        if offset is None:
            return PutResult(False, evicted)
        # The slot is reserved: no reader sees it and nothing evicts it, so copy unlocked.
        self._buf[offset : offset + self.block_bytes] = data
        return PutResult(self.commit(key, block_checksum(data)), evicted)

    def remove(self, key: bytes) -> bool:
        with self._lock:
            return self._remove(key)

    def _stats(self) -> dict:
        return {"pinned": len(self._pins), "reserved": len(self._reserved)}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._index.clear()
            self._policy.clear()
        self._buf = None
        self._shm.close()
        self._shm.unlink()

    # -- internals (lock held) ---------------------------------------------------------------------

    def _reserve(self, key: bytes, position: int, evicted: list[bytes]) -> int | None:
        """Returns the slot's offset; appends evicted keys to ``evicted``."""
        if key in self._index or key in self._reserved or key in self._doomed:
            return None
        if not self._free:
            victim = self._policy.victim(skip=self._pins)
            if victim is None:
                self._counters["failed_writes"] += 1
                return None
            slot = self._index[victim]
            if self.on_evict is not None:
                self._hand_over(victim, slot * self.block_bytes)
            self._remove(victim)
            self._counters["evictions"] += 1
            evicted.append(victim)
        slot = self._free.pop()
        self._reserved[key] = (slot, position)
        return slot * self.block_bytes

    def _hand_over(self, key: bytes, offset: int) -> None:
        view = self._buf[offset : offset + self.block_bytes].toreadonly()
        try:
            self.on_evict(key, view)
        except Exception:  # a failed demotion loses the block, never the put
            logger.exception("on_evict failed for a DRAM victim; the block is dropped")
        finally:
            view.release()

    def _remove(self, key: bytes) -> bool:
        slot = self._index.pop(key, None)
        if slot is None:
            return False
        self._sums.pop(key, None)
        self._policy.on_remove(key)
        if key in self._pins:
            self._doomed[key] = slot
        else:
            self._free.append(slot)
        return True

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the resource tracker unlinks what is left
            pass


def remove_orphan_arenas(shm_dir: str = _SHM_DIR) -> list[str]:
    """Unlink the DRAM arenas (``engine-kv-<pid>-<hex>``) whose owning process is gone."""
    return remove_orphan_files(SHM_PREFIX, shm_dir)
