"""The contract every tier of the KV block store keeps (DRAM arena, SSD records, pool service,
Mooncake Store).

A tier holds fixed-size blocks (``block_bytes``: one block's KV for every layer, the layout fixed
by the store's namespace) under 32-byte keys (the chained prefix hashes of
``engine/kvcache/prefix_hash.py``). Tiers are thread-safe: the engine's loader and writer threads
call them while the step loop runs. A read either copies a whole verified block or misses: a
block that is corrupt, truncated, half-written or from a foreign namespace is a miss (and is
removed), never an exception and never wrong data.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import NamedTuple


class PutResult(NamedTuple):
    stored: bool  # False: not stored (full, disk error, too big, service down); never raises
    evicted: list[bytes]  # keys this put evicted from the tier (a DRAM tier demotes them first)


class Tier(ABC):
    """One level of the store. ``name`` is the source label the engine reports: ``dram``,
    ``ssd`` or ``remote``."""

    name: str

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """True if a get_into of key would (barring a race or corruption) hit."""

    @abstractmethod
    def get_into(self, key: bytes, out: memoryview) -> bool:
        """Copy the block into ``out`` (exactly block_bytes, writable). False on a miss or a bad
        record (removed). Counts as an access for the eviction policy."""

    @abstractmethod
    def put(self, key: bytes, data: memoryview, position: int = 0) -> PutResult:
        """Store a block (``position``: its index in the request's chain of blocks, for the
        length-aware policy). Storing a key that is present only refreshes it."""

    @abstractmethod
    def remove(self, key: bytes) -> bool: ...

    @abstractmethod
    def clear(self) -> int:
        """Drop every block; returns how many."""

    @abstractmethod
    def stats(self) -> dict:
        """Counters and gauges: at least blocks, capacity_blocks, hits, misses, bytes_read,
        bytes_written, evictions, failed_reads, failed_writes."""

    def close(self) -> None:  # noqa: B027 (optional)
        """Release OS resources (shared memory, sockets, file handles)."""


def block_views(outs: Sequence, block_bytes: int) -> list[memoryview]:
    """``outs`` as byte views, each exactly one block (ValueError otherwise)."""
    views = [memoryview(o).cast("B") for o in outs]
    for v in views:
        if v.nbytes != block_bytes:
            raise ValueError(f"out has {v.nbytes} bytes, a block has {block_bytes}")
    return views


def read_prefix(
    keys: Sequence[bytes],
    views: list[memoryview],
    batch: int,
    get_chunk: Callable[[list[bytes], list[memoryview]], int],
) -> int:
    """Read the leading blocks of ``keys`` into ``views``, ``batch`` keys per call of
    ``get_chunk`` (which returns how many of its chunk it read: a prefix); how many in all."""
    done = 0
    while done < len(keys):
        chunk = list(keys[done : done + batch])
        n = get_chunk(chunk, views[done : done + len(chunk)])
        done += n
        if n < len(chunk):
            break
    return done


COUNTERS = ("hits", "misses", "bytes_read", "bytes_written", "evictions", "failed_reads")


class LocalTier(Tier):
    """A tier of this process (the DRAM arena, the SSD records): an index of its keys under one
    lock, and the counters every tier reports. Subclasses fill ``_index`` and remove a block with
    ``_remove`` (lock held); ``_stats`` adds their own gauges."""

    capacity_blocks: int
    block_bytes: int

    def __init__(self, *extra_counters: str) -> None:
        self._lock = threading.Lock()
        self._index: dict[bytes, object] = {}
        self._counters = dict.fromkeys((*COUNTERS, "failed_writes", *extra_counters), 0)

    @abstractmethod
    def _remove(self, key: bytes) -> bool:
        """Drop ``key`` (the lock is held); False if it was not there."""

    def _clearing(self) -> None:  # noqa: B027 (optional)
        """Called with the lock held before ``clear`` removes every block."""

    def _stats(self) -> dict:
        return {}

    def contains(self, key: bytes) -> bool:
        return key in self._index

    def clear(self) -> int:
        with self._lock:
            self._clearing()
            keys = list(self._index)
            for key in keys:
                self._remove(key)
            return len(keys)

    def stats(self) -> dict:
        with self._lock:
            return {
                **self._counters,
                "blocks": len(self._index),
                "capacity_blocks": self.capacity_blocks,
                "block_bytes": self.block_bytes,
                **self._stats(),
            }

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._index)
