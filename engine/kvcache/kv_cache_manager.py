"""Per-request view of the paged cache: block tables, prefix-cache hits, allocation, freeing."""

from __future__ import annotations

from typing import NamedTuple, Protocol

from engine.kvcache.block_pool import BlockListener, BlockPool
from engine.kvcache.prefix_hash import hash_blocks


class CacheableRequest(Protocol):
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    extra_keys: tuple


class PrefixHit(NamedTuple):
    blocks: list[int]
    num_tokens: int


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        listener: BlockListener | None = None,
    ):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, listener)
        self.block_tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        # Counters in tokens (exported as metrics by the engine).
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def block_hashes(self, req: CacheableRequest) -> list[bytes]:
        """Hashes of req's full blocks, extended incrementally as tokens are appended."""
        hashes = self._hashes.setdefault(req.request_id, [])
        if len(hashes) < len(req.all_token_ids) // self.block_size:
            parent = hashes[-1] if hashes else None
            hashes += hash_blocks(
                req.all_token_ids, self.block_size, req.extra_keys, parent, len(hashes)
            )
        return hashes

    def find_prefix(self, req: CacheableRequest, max_tokens: int | None = None) -> PrefixHit:
        """Longest run of cached blocks at the start of req, of at most ``max_tokens`` tokens
        (whole blocks) when given. At least one token is always left to compute, since the last
        prompt position must run to produce logits."""
        if not self.enable_prefix_caching:
            return PrefixHit([], 0)
        bs = self.block_size
        max_blocks = (len(req.all_token_ids) - 1) // bs
        if max_tokens is not None:
            max_blocks = min(max_blocks, max(0, max_tokens) // bs)
        blocks: list[int] = []
        for i, h in enumerate(self.block_hashes(req)[:max_blocks]):
            block = self.pool.lookup(h, req.all_token_ids[i * bs : (i + 1) * bs])
            if block is None:
                break
            blocks.append(block)
        self.prefix_queries += len(req.all_token_ids)
        self.prefix_hits += len(blocks) * bs
        return PrefixHit(blocks, len(blocks) * bs)

    def can_allocate(self, req: CacheableRequest, num_new_tokens: int, hit: PrefixHit) -> bool:
        return self._blocks_needed(req, num_new_tokens, hit) <= self.pool.num_free

    def allocate(
        self,
        req: CacheableRequest,
        num_new_tokens: int,
        hit: PrefixHit | None = None,
        reserve: int = 0,
    ) -> bool:
        """Make room for num_new_tokens more tokens of req (after its prefix-cache hit, if any),
        leaving at least ``reserve`` blocks free. Returns False, changing nothing, when the pool
        is short."""
        hit = hit or PrefixHit([], 0)
        if self._blocks_needed(req, num_new_tokens, hit) > self.pool.num_free - reserve:
            return False
        table = self.block_tables.setdefault(req.request_id, [])
        if hit.blocks:
            assert not table, "prefix hits apply only to a request with no blocks yet"
            self.pool.touch(hit.blocks)
            table.extend(hit.blocks)
            self._num_cached_blocks[req.request_id] = len(hit.blocks)
        total = req.num_computed_tokens + hit.num_tokens + num_new_tokens
        need = -(-total // self.block_size) - len(table)
        if need > 0:
            table.extend(self.pool.allocate(need))
        return True

    def _blocks_needed(self, req: CacheableRequest, num_new_tokens: int, hit: PrefixHit) -> int:
        table = self.block_tables.get(req.request_id, ())
        total = req.num_computed_tokens + hit.num_tokens + num_new_tokens
        need = max(0, -(-total // self.block_size) - len(table) - len(hit.blocks))
        # Reviving a cached hit block takes it out of the allocatable queue.
        revived = sum(1 for b in hit.blocks if self.pool.ref_cnt[b] == 0)
        return need + revived

    def cache_computed_blocks(self, req: CacheableRequest) -> None:
        """Name the blocks of req that are full and computed, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        num_full = req.num_computed_tokens // self.block_size
        start = self._num_cached_blocks.get(req.request_id, 0)
        if num_full <= start:
            return
        table = self.block_tables[req.request_id]
        hashes = self.block_hashes(req)
        bs = self.block_size
        for i in range(start, num_full):
            self.pool.cache(table[i], hashes[i], req.all_token_ids[i * bs : (i + 1) * bs])
        self._num_cached_blocks[req.request_id] = num_full

    def trim(self, req: CacheableRequest, num_tokens: int) -> int:
        """Free req's blocks past those that hold its first ``num_tokens`` tokens (blocks a
        step allocated for draft tokens it did not keep; never a named one). Returns how many."""
        table = self.block_tables.get(req.request_id)
        keep = -(-num_tokens // self.block_size)
        if table is None or len(table) <= keep:
            return 0
        assert keep >= self._num_cached_blocks.get(req.request_id, 0)
        extra = table[keep:]
        del table[keep:]
        self.pool.free(reversed(extra))
        return len(extra)

    def free(self, req: CacheableRequest) -> None:
        table = self.block_tables.pop(req.request_id, [])
        self.pool.free(reversed(table))
        self._num_cached_blocks.pop(req.request_id, None)
        self._hashes.pop(req.request_id, None)

    def check_integrity(self) -> None:
        counts = self.pool.check_integrity()
        held: dict[int, int] = {}
        for table in self.block_tables.values():
            for b in table:
                held[b] = held.get(b, 0) + 1
        for b in range(self.pool.num_blocks):
            assert self.pool.ref_cnt[b] == held.get(b, 0), (b, self.pool.ref_cnt[b], held.get(b))
        assert counts.used == len(held)
