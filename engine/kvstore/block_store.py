"""The block store: KV blocks outside the paged cache, keyed by chained prefix hash, in tiers.

Tiers are looked up in order (DRAM, SSD, then at most one remote tier: a pool service or the
Mooncake Store). A put goes into the first local tier (the next if it cannot take the block,
e.g. every DRAM slot is leased); blocks the DRAM tier evicts are demoted to
the next local tier (the SSD) before their slot is reused; a remote tier, if configured, gets
every put as well (write-through), so other engines can find the block. A hit in a lower tier
is promoted into the first local tier, so a prefix that is read again comes from DRAM.

Every tier is thread-safe and the store keeps no state of its own beyond the tier list, so the
engine's loader and writer threads may call it concurrently.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.kvstore.namespace import KVNamespace
from engine.kvstore.tier import Tier

if TYPE_CHECKING:
    from engine.pool_spec import PoolSpec

logger = logging.getLogger(__name__)

LOCAL_TIERS = ("dram", "ssd")
PREFETCH_WINDOW = 16  # SSD records read ahead by get_many


class BlockStore:
    def __init__(self, tiers: Sequence[Tier], namespace: KVNamespace) -> None:
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tiers must have distinct names, got {names}")
        self.namespace = namespace
        self.block_bytes = namespace.block_bytes
        self.tiers = list(tiers)
        self.local = [t for t in self.tiers if t.name in LOCAL_TIERS]
        remote = [t for t in self.tiers if t.name not in LOCAL_TIERS]
        if len(remote) > 1:
            raise ValueError(f"at most one remote tier, got {[t.name for t in remote]}")
        self.remote = remote[0] if remote else None
        # Demotion chain: each local tier's victims go to the next local tier.
        for upper, lower in zip(self.local, self.local[1:]):
            if hasattr(upper, "on_evict"):
                upper.on_evict = _demoter(lower)

    def match(self, keys: Sequence[bytes]) -> int:
        """How many leading keys some tier holds."""
        return len(self.locate(keys))

    def locate(self, keys: Sequence[bytes]) -> list[str]:
        """The name of the first tier holding each matched leading key. The remote tier is
        asked once per run of keys the local tiers miss (one round trip for the whole run)."""
        out: list[str] = []
        remote_end = 0  # keys[len(out):remote_end] are known to be in the remote tier
        for i, key in enumerate(keys):
            name = next((t.name for t in self.local if t.contains(key)), None)
            if name is None and self.remote is not None:
                if i >= remote_end:
                    remote_end = i + _remote_match(self.remote, keys[i:])
                if i < remote_end:
                    name = self.remote.name
            if name is None:
                break
            out.append(name)
        return out

    def get_into(self, key: bytes, out: memoryview) -> str | None:
        """Copy the block into ``out``; the name of the tier that served it, or None on a miss."""
        for i, tier in enumerate(self.tiers):
            if tier.get_into(key, out):
                if i > 0 and self.local and tier is not self.local[0]:
                    self._promote(key, out)
                return tier.name
        return None

    def get_many(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[str | None]:
        """get_into for each key, with the SSD records of the next PREFETCH_WINDOW keys read
        ahead meanwhile, and each run of keys the local tiers miss fetched from the remote tier
        in one batch (``get_many_into``: one round trip per batch, not per block)."""
        prefetchers = [t.prefetch for t in self.tiers if hasattr(t, "prefetch")]
        for prefetch in prefetchers:
            prefetch(keys[:PREFETCH_WINDOW])
        batch_get = getattr(self.remote, "get_many_into", None)
        served: list[str | None] = []
        i = 0
        while i < len(keys):
            for prefetch in prefetchers:
                prefetch(keys[i + PREFETCH_WINDOW : i + PREFETCH_WINDOW + 1])
            if batch_get is None or any(t.contains(keys[i]) for t in self.local):
                served.append(self.get_into(keys[i], outs[i]))
                i += 1
                continue
            j = i + 1
            while j < len(keys) and not any(t.contains(keys[j]) for t in self.local):
                j += 1
            n = batch_get(keys[i:j], outs[i:j])
            for k in range(i, i + n):
                if self.local:
                    self._promote(keys[k], outs[k])
            served += [self.remote.name] * n + [None] * (j - i - n)
            i = j
        return served

    def put_many(
        self, keys: Sequence[bytes], datas: Sequence[memoryview], positions: Sequence[int]
    ) -> list[bool]:
        """put for each block; the remote tier gets them in batches (``put_many``)."""
        batch_put = getattr(self.remote, "put_many", None)
        if batch_put is None:
            return [self.put(k, d, p) for k, d, p in zip(keys, datas, positions)]
        stored = [False] * len(keys)
        for n, (key, data, pos) in enumerate(zip(keys, datas, positions)):
            for tier in self.local:
                if tier.put(key, data, pos).stored:
                    stored[n] = True
                    break
        remote = batch_put(keys, datas, positions)
        return [a or b for a, b in zip(stored, remote)]

    def put(self, key: bytes, data: memoryview, position: int = 0) -> bool:
        """Store a block; True if some tier holds it now. Never raises for tier failures."""
        if memoryview(data).nbytes != self.block_bytes:
            logger.warning("block store: put of %d bytes refused", memoryview(data).nbytes)
            return False
        stored = False
        for tier in self.local:  # the next local tier only if one cannot take it (all pinned)
            if tier.put(key, data, position).stored:
                stored = True
                break
        if self.remote is not None:
            stored = self.remote.put(key, data, position).stored or stored
        return stored

    def contains(self, key: bytes) -> bool:
        return self.match([key]) == 1

    def remove(self, key: bytes) -> bool:
        removed = False
        for tier in self.tiers:
            removed = tier.remove(key) or removed
        return removed

    def clear(self) -> int:
        """Drop every block of every tier (the remote one too); returns how many."""
        return sum(tier.clear() for tier in self.tiers)

    def stats(self) -> dict:
        return {tier.name: tier.stats() for tier in self.tiers}

    def close(self) -> None:
        for tier in self.tiers:
            try:
                tier.close()
            except Exception:
                logger.exception("closing the %s tier failed", tier.name)

    def _promote(self, key: bytes, data: memoryview) -> None:
        self.local[0].put(key, data)


def _demoter(lower: Tier):
    def demote(key: bytes, view: memoryview) -> None:
        lower.put(key, view)

    return demote


def _remote_match(tier: Tier, keys: Sequence[bytes]) -> int:
    """One round trip if the tier can match a whole prefix (pool service, Mooncake), else one
    contains() per key."""
    match_prefix = getattr(tier, "match_prefix", None)
    if match_prefix is not None:
        return match_prefix(keys)
    n = 0
    for key in keys:
        if not tier.contains(key):
            break
        n += 1
    return n


def build_block_store(spec: PoolSpec, namespace: KVNamespace) -> BlockStore:
    """The store a parsed ``kv_pool`` string describes. Remote tiers are imported lazily: the
    Mooncake backend is an optional extra."""
    from engine.pool_spec import MooncakeSpec, ServiceSpec

    tiers: list[Tier] = []
    try:
        if spec.dram is not None:
            from engine.kvstore.dram_tier import DramTier

            tiers.append(DramTier(spec.dram.size, namespace, policy=spec.policy))
        if spec.ssd is not None:
            from engine.kvstore.ssd_tier import SsdTier

            tiers.append(SsdTier(spec.ssd.path, spec.ssd.size, namespace, policy=spec.policy))
        if isinstance(spec.remote, ServiceSpec):
            from engine.kvstore.service_tier import PoolClientTier

            tiers.append(PoolClientTier(spec.remote.address, namespace))
        elif isinstance(spec.remote, MooncakeSpec):
            from engine.kvstore.mooncake_tier import MooncakeTier

            tiers.append(MooncakeTier(spec.remote, namespace))
        return BlockStore(tiers, namespace)
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
