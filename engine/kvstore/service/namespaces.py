"""The pool service's stores: one BlockStore per namespace, with the leases and reservations that
let clients on the host read and write its DRAM arena directly.

A lease (``get`` through shared memory) pins a block's slot until the client releases it or the
lease deadline passes; a reservation (``reserve``) holds a slot being written until ``commit``,
``abort`` or its deadline. Both are tracked per peer, so one client cannot end another's.
Blocks that leave the pool (removed, cleared, or evicted from the last local tier) and blocks
that enter it are reported to ``publish(kind, namespace_id, keys)``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from engine.kvstore import block_record
from engine.kvstore.block_store import BlockStore
from engine.kvstore.dram_tier import DramTier
from engine.kvstore.namespace import KVNamespace
from engine.kvstore.service import protocol as P
from engine.kvstore.ssd_tier import SsdTier
from engine.kvstore.tier import PutResult

Publish = Callable[[str, bytes, list], None]


class _WatchedSsd(SsdTier):
    """An SSD tier that reports the blocks its puts evict (they leave the pool)."""

    on_removed: Callable[[list], None] | None = None

    def put(self, key: bytes, data: memoryview, position: int = 0) -> PutResult:
        result = super().put(key, data, position)
        if result.evicted and self.on_removed is not None:
            self.on_removed(result.evicted)
        return result


class NamespaceStore:
    def __init__(self, namespace: KVNamespace, config, publish: Publish) -> None:
        self.namespace = namespace
        self.lease_s = config.lease_s
        self._publish = publish
        self.dram: DramTier | None = None
        self.ssd: _WatchedSsd | None = None
        tiers = []
        try:
            if config.dram_bytes > 0:
                self.dram = DramTier(config.dram_bytes, namespace, policy=config.policy)
                tiers.append(self.dram)
            if config.ssd_path is not None:
                self.ssd = _WatchedSsd(
                    config.ssd_path, config.ssd_bytes, namespace, policy=config.policy
                )
                self.ssd.on_removed = self._removed
                tiers.append(self.ssd)
            self.store = BlockStore(tiers, namespace)
        except BaseException:
            for tier in tiers:
                tier.close()
            raise
        if self.dram is not None:
            demote = self.dram.on_evict  # the store's demotion to the SSD, if any

            def on_evict(key: bytes, view: memoryview) -> None:
                if demote is not None:
                    demote(key, view)
                if self.ssd is None or not self.ssd.contains(key):
                    self._removed([key])

            self.dram.on_evict = on_evict
        self._lock = threading.Lock()
        self._leases: dict[tuple[bytes, bytes], list[float]] = {}  # (peer, key) -> deadlines
        self._reserved: dict[bytes, tuple[bytes, float]] = {}  # key -> (peer, deadline)
        self._gone: list[bytes] = []  # removed keys not yet published

    # -- reads -------------------------------------------------------------------------------------

    def get(
        self, peer: bytes, keys: Sequence[bytes], shm: bool, max_bytes: int, now: float
    ) -> tuple[list[int], list[bytearray], list[int]]:
        """Offsets (leased arena offsets, or INLINE) for the leading keys found, the inline
        records, and per offset the leased block's checksum (0 for INLINE). Stops at the first
        miss or when the inline bytes would pass ``max_bytes``."""
        offsets: list[int] = []
        frames: list[bytearray] = []
        sums: list[int] = []
        record_bytes = block_record.HEADER_SIZE + self.namespace.block_bytes
        for key in keys:
            if shm and self.dram is not None and self.dram.contains(key):
                offset = self.dram.lease(key)
                if offset is not None:
                    with self._lock:
                        self._leases.setdefault((peer, key), []).append(now + self.lease_s)
                    offsets.append(offset)
                    sums.append(self.dram.checksum(key) or 0)
                    continue
            if (len(frames) + 1) * record_bytes > max_bytes and offsets:
                break
            record = bytearray(record_bytes)
            view = memoryview(record)
            payload = view[block_record.HEADER_SIZE :]
            if self.store.get_into(key, payload) is None:
                break
            view[: block_record.HEADER_SIZE] = block_record.encode_header(
                self.namespace.id, key, payload
            )
            frames.append(record)
            offsets.append(P.INLINE)
            sums.append(0)
        self._flush()
        return offsets, frames, sums

    def release(self, peer: bytes, keys: Sequence[bytes]) -> None:
        for key in keys:
            with self._lock:
                deadlines = self._leases.get((peer, key))
                if not deadlines:
                    continue  # expired already (and released then)
                deadlines.pop(0)
                if not deadlines:
                    del self._leases[(peer, key)]
            self.dram.release(key)

    # -- writes ------------------------------------------------------------------------------------

    def put(self, keys: Sequence[bytes], positions: Sequence[int], frames: Sequence) -> list[bool]:
        stored = []
        for key, position, frame in zip(keys, positions, frames):
            payload = block_record.decode_and_verify(self.namespace.id, key, frame)
            ok = payload is not None and self.store.put(key, payload, position)
            stored.append(ok)
        self._publish("stored", self.namespace.id, [k for k, ok in zip(keys, stored) if ok])
        self._flush()
        return stored

    def reserve(
        self, peer: bytes, keys: Sequence[bytes], positions: Sequence[int], now: float
    ) -> list[int]:
        if self.dram is None:
            return [P.NO_ROOM] * len(keys)
        offsets = []
        for key, position in zip(keys, positions):
            if self.dram.contains(key):
                offsets.append(P.PRESENT)
                continue
            offset = self.dram.reserve(key, position)
            if offset is None:
                offsets.append(P.NO_ROOM)
                continue
            with self._lock:
                self._reserved[key] = (peer, now + self.lease_s)
            offsets.append(offset)
        self._flush()  # the reservations may have evicted blocks
        return offsets

    def commit(
        self, peer: bytes, keys: Sequence[bytes], checksums: Sequence[int] = ()
    ) -> list[bool]:
        """checksums: per key, what the writer hashed (none: not checked)."""
        stored = []
        for i, key in enumerate(keys):
            with self._lock:
                owned = self._reserved.get(key, (None,))[0] == peer
                if owned:
                    del self._reserved[key]
            expected = checksums[i] if i < len(checksums) else None
            stored.append(owned and self.dram.commit(key, expected))
        self._publish("stored", self.namespace.id, [k for k, ok in zip(keys, stored) if ok])
        return stored

    def abort(self, peer: bytes, keys: Sequence[bytes]) -> None:
        for key in keys:
            with self._lock:
                owned = self._reserved.get(key, (None,))[0] == peer
                if owned:
                    del self._reserved[key]
            if owned:
                self.dram.abort(key)

    def remove(self, keys: Sequence[bytes]) -> int:
        removed = [k for k in keys if self.store.remove(k)]
        self._publish("removed", self.namespace.id, removed)
        return len(removed)

    def clear(self) -> int:
        keys: set[bytes] = set()
        for tier in (self.dram, self.ssd):
            if tier is not None:
                keys.update(tier.keys())
        count = self.store.clear()
        self._publish("removed", self.namespace.id, sorted(keys))
        return count

    # -- upkeep ------------------------------------------------------------------------------------

    def stats(self) -> dict:
        with self._lock:
            leases = sum(len(d) for d in self._leases.values())
            reserved = len(self._reserved)
        return {"tiers": self.store.stats(), "leases": leases, "reservations": reserved}

    def num_leases(self) -> int:
        with self._lock:
            return sum(len(d) for d in self._leases.values())

    def expire(self, now: float) -> None:
        """End the leases and reservations whose deadline passed (their clients died or hung)."""
        released: list[bytes] = []
        aborted: list[bytes] = []
        with self._lock:
            for lk, deadlines in list(self._leases.items()):
                while deadlines and deadlines[0] <= now:
                    deadlines.pop(0)
                    released.append(lk[1])
                if not deadlines:
                    del self._leases[lk]
            for key, (_, deadline) in list(self._reserved.items()):
                if deadline <= now:
                    del self._reserved[key]
                    aborted.append(key)
        for key in released:
            self.dram.release(key)
        for key in aborted:
            self.dram.abort(key)

    def close(self) -> None:
        self.store.close()

    def _removed(self, keys: list) -> None:
        with self._lock:
            self._gone.extend(keys)

    def _flush(self) -> None:
        with self._lock:
            gone, self._gone = self._gone, []
        self._publish("removed", self.namespace.id, gone)


class NamespaceTable:
    """The stores by namespace id, created on ``hello``."""

    def __init__(self, config, publish: Publish) -> None:
        self.config = config
        self._publish = publish
        self._lock = threading.Lock()
        self._stores: dict[bytes, NamespaceStore] = {}

    def open(self, hello: P.Hello) -> NamespaceStore:
        try:
            namespace = KVNamespace(
                model_digest=hello.model_digest,
                dtype=hello.dtype,
                block_size=hello.block_size,
                num_layers=hello.num_layers,
                num_kv_heads=hello.num_kv_heads,
                head_dim=hello.head_dim,
            )
        except ValueError as exc:
            raise P.ProtocolError(f"hello: {exc}") from None
        if namespace.id != hello.namespace:
            raise P.ProtocolError(
                f"hello: namespace {hello.namespace.hex()} does not match its fields "
                f"({namespace.id.hex()})"
            )
        with self._lock:
            store = self._stores.get(namespace.id)
            if store is not None:
                return store
            if len(self._stores) >= self.config.max_namespaces:
                raise P.ProtocolError(
                    f"hello: the pool serves at most {self.config.max_namespaces} namespaces"
                )
            try:
                store = NamespaceStore(namespace, self.config, self._publish)
            except ValueError as exc:  # e.g. the DRAM size holds no block of this layout
                raise P.ProtocolError(f"hello: {exc}") from None
            self._stores[namespace.id] = store
            return store

    def get(self, namespace_id: bytes) -> NamespaceStore | None:
        with self._lock:
            return self._stores.get(namespace_id)

    def select(self, namespace_id: bytes) -> list[NamespaceStore]:
        """Every store if ``namespace_id`` is empty, else that one (none if unknown)."""
        with self._lock:
            if not namespace_id:
                return list(self._stores.values())
            store = self._stores.get(namespace_id)
            return [] if store is None else [store]

    def num_leases(self) -> int:
        return sum(s.num_leases() for s in self.select(b""))

    def expire(self, now: float) -> None:
        for store in self.select(b""):
            store.expire(now)

    def close(self) -> None:
        with self._lock:
            stores, self._stores = list(self._stores.values()), {}
        for store in stores:
            store.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._stores)
