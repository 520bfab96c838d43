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

from abc import ABC, abstractmethod
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
