"""The paged cache's block allocator: reference counts, prefix-cache index and LRU reuse.

Every block is in exactly one state:
- used: ref_cnt > 0 (held by one or more requests, shared prefix blocks have ref_cnt > 1);
- cached: ref_cnt == 0 but still named by a hash, so a later request can revive it;
- free: ref_cnt == 0 and no hash.
Cached and free blocks sit together in one LRU queue; allocation takes the least recently freed
block first and drops its hash, so a cached prefix survives until it is the oldest unused block.
``check_integrity`` asserts free + cached + used == total and that the index is consistent.

``listener``, when given, hears ("stored", hash) when a block is named and ("removed", hash) when a
name is dropped (evicted or reset), so that an engine can publish which prefixes it holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

BlockListener = Callable[[str, bytes], None]  # ("stored" | "removed", block hash)


class BlockCounts(NamedTuple):
    free: int
    cached: int
    used: int
    total: int


class BlockPool:
    def __init__(self, num_blocks: int, listener: BlockListener | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        # LRU queue of blocks with ref_cnt == 0: first = evicted first.
        self._lru: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._index: dict[bytes, int] = {}
        self.listener = listener

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free or cached)."""
        return len(self._lru)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._lru):
            raise MemoryError(f"asked for {n} blocks, {len(self._lru)} available")
        out = []
        for _ in range(n):
            block, _ = self._lru.popitem(last=False)
            self._drop_hash(block)
            self.ref_cnt[block] = 1
            out.append(block)
        return out

    def lookup(self, block_hash: bytes, tokens: Sequence[int]) -> int | None:
        """The cached block named block_hash whose tokens equal ``tokens`` (hit confirmed)."""
        block = self._index.get(block_hash)
        if block is None or self.block_tokens[block] != tuple(tokens):
            return None
        return block

    def touch(self, blocks: Iterable[int]) -> None:
        """Take a reference on prefix-cache hits (reviving cached blocks)."""
        for block in blocks:
            if self.ref_cnt[block] == 0:
                del self._lru[block]
            self.ref_cnt[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference each. Callers pass a request's blocks tail first, so that its
        last blocks (least likely to be shared) are evicted before its prefix."""
        for block in blocks:
            if self.ref_cnt[block] <= 0:
                raise RuntimeError(f"block {block} freed more often than allocated")
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self._lru[block] = None

    def cache(self, block: int, block_hash: bytes, tokens: Sequence[int]) -> None:
        """Name a full, computed block so later requests can reuse it. If another block already
        holds that name (two requests computed the same prefix at once), the first one keeps it."""
        if self.block_hash[block] is not None or block_hash in self._index:
            return
        self.block_hash[block] = block_hash
        self.block_tokens[block] = tuple(tokens)
        self._index[block_hash] = block
        if self.listener is not None:
            self.listener("stored", block_hash)

    def evict_all_cached(self) -> int:
        """Forget every cached (unreferenced) block's name; returns how many were dropped."""
        dropped = [b for b in self._lru if self.block_hash[b] is not None]
        for block in dropped:
            self._drop_hash(block)
        return len(dropped)

    def _drop_hash(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            if self._index.get(h) == block:
                del self._index[h]
            self.block_hash[block] = None
            self.block_tokens[block] = None
            if self.listener is not None:
                self.listener("removed", h)

    def counts(self) -> BlockCounts:
        used = sum(1 for r in self.ref_cnt if r > 0)
        cached = sum(1 for b in self._lru if self.block_hash[b] is not None)
        return BlockCounts(len(self._lru) - cached, cached, used, self.num_blocks)

    def check_integrity(self) -> BlockCounts:
        counts = self.counts()
        assert counts.free + counts.cached + counts.used == counts.total, counts
        for block in range(self.num_blocks):
            assert self.ref_cnt[block] >= 0, (block, self.ref_cnt[block])
            assert (self.ref_cnt[block] == 0) == (block in self._lru), block
        for h, block in self._index.items():
            assert self.block_hash[block] == h, block
        named = sum(1 for h in self.block_hash if h is not None)
        assert named == len(self._index), (named, len(self._index))
        return counts
