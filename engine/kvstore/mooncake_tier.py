"""The Mooncake Store as the remote tier (``mooncake://HOST:RPC_PORT?metadata=URL`` in --kv-pool).

The Mooncake authors' distributed KV store (PyPI ``mooncake-transfer-engine-non-cuda``, the
optional extra ``engine[mooncake]``; its module loads Debian's ``libibverbs.so.1`` even over TCP)
pools the memory that long-lived processes lend it: ``mooncake_master`` keeps the directory,
``engine pool serve --mooncake URL&segment=SIZE`` (``lend_memory``) or Mooncake's own
``mc_store_rest_server`` lend segments. An engine is a client that lends none unless its URL says
``&segment=SIZE``; objects in a client's own segment vanish with that client.

Objects: key ``<namespace id hex><block key hex>``, value a block record (block_record.py:
header + payload), so the namespace, length and checksum are verified on every read as for an
SSD record; a bad object (another size, a foreign or corrupt record) is a miss and is removed.

Data moves zero-copy between the store and a per-thread staging buffer registered with the client
(``put_from`` / ``get_into``), so a pure client needs no local transfer buffer: ``put``/``get`` of
Python bytes go through that buffer and fail (-600) without one, the registered path does not.
``&buffer=SIZE`` still sets it (Mooncake's ``local_buffer_size``), for other users of the client.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Sequence

import numpy as np

from engine.kvstore import block_record
from engine.kvstore.namespace import KVNamespace
from engine.kvstore.tier import PutResult, Tier, block_views, read_prefix

logger = logging.getLogger(__name__)

OBJECT_NOT_FOUND = -704  # Mooncake's ErrorCode::OBJECT_NOT_FOUND
INVALID_PARAMS = -600  # e.g. the object does not fit the buffer: not one of our records
RPC_FAIL = -900  # the master did not answer
MAX_BATCH_BYTES = 64 << 20  # records in one batch call (the staging buffer's size)
PROBE_TIMEOUT_S = 2.0
_BACKOFF_S = (
    1.0,
    2.0,
    5.0,
    10.0,
)  # calls fail at once this long after the master stopped answering


class MooncakeUnavailable(ImportError):
    """The optional Mooncake package or the library it loads is missing; the text says which."""


def load_store_class():
    """``mooncake.store.MooncakeDistributedStore``, or MooncakeUnavailable saying what to
    install."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        text = str(exc)
        if "libibverbs" in text or "librdmacm" in text or "libnuma" in text:
            raise MooncakeUnavailable(
                f"the Mooncake Store backend needs Debian's libibverbs1 (it is loaded even over "
                f"TCP): apt-get install libibverbs1 ({text})"
            ) from None
        raise MooncakeUnavailable(
            "the Mooncake Store backend needs the optional package: pip install "
            f"'engine[mooncake]' (mooncake-transfer-engine-non-cuda) ({text})"
        ) from None
    return MooncakeDistributedStore


def local_hostname(master_host: str) -> str:
    """The address other store members reach this process at: loopback for a local master,
    else the interface that routes to the master."""
    if master_host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_host, 9))  # no packet is sent; the kernel picks the route
        return s.getsockname()[0]


def _probe(spec, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Fail at once if the master does not accept connections: the client's own setup retries
    an unreachable master for about 90 s."""
    try:
        socket.create_connection((spec.host, spec.rpc_port), timeout=timeout).close()
    except OSError as exc:
        raise ConnectionError(f"Mooncake master {spec.master} is not reachable: {exc}") from None


def _setup(spec, segment: int, buffer: int):
    store_class = load_store_class()
    _probe(spec)
    store = store_class()
    rc = store.setup(
        local_hostname(spec.host), spec.metadata, segment, buffer, "tcp", "", spec.master
    )
    if rc != 0:
        raise ConnectionError(
            f"Mooncake Store setup failed (rc={rc}): master {spec.master}, metadata "
            f"{spec.metadata}; is mooncake_master running with its HTTP metadata server?"
        )
    return store


class MooncakeTier(Tier):
    name = "remote"

    def __init__(self, spec, namespace: KVNamespace) -> None:
        """spec: pool_spec.MooncakeSpec (host, rpc_port, metadata, segment, buffer)."""
        self.spec = spec
        self.namespace = namespace
        self.block_bytes = namespace.block_bytes
        self.record_bytes = block_record.HEADER_SIZE + self.block_bytes
        self._prefix = namespace.id.hex()
        self.batch_keys = max(1, MAX_BATCH_BYTES // self.record_bytes)
        self._store = _setup(spec, spec.segment, spec.buffer)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._buffers: list[np.ndarray] = []
        self._closed = False
        self._counters = dict.fromkeys(
            ("hits", "misses", "bytes_read", "bytes_written", "evictions", "failed_reads"), 0
        )
        self._counters.update(failed_writes=0, faults=0)
        self._failures = 0  # consecutive faults; > 0: the store is down until _down_until
        self._down_until = 0.0

    def object_key(self, key: bytes) -> str:
        return self._prefix + key.hex()

    # -- the Tier contract -------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        return self.match_prefix([key]) == 1

    def match_prefix(self, keys) -> int:
        """How many leading keys the store holds: one round trip."""
        if not keys or self._is_down():
            return 0
        found = self._store.batch_is_exist([self.object_key(k) for k in keys])
        n = 0
        for f in found:
            if f != 1:
                break
            n += 1
        if n < len(found) and found[n] < 0:  # an error, not a miss
            self._fault(f"exists returned {found[n]}")
        else:
            self._ok()
        return n

    def get_into(self, key: bytes, out: memoryview) -> bool:
        return self.get_many_into([key], [out]) == 1

    def put(self, key: bytes, data: memoryview, position: int = 0) -> PutResult:
        return PutResult(self.put_many([key], [data])[0], [])

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence) -> int:
        """Copy the leading blocks of ``keys`` the store holds into ``outs``; how many (a
        prefix). One batch call per ``batch_keys`` keys."""
        views = block_views(outs, self.block_bytes)
        done = read_prefix(keys, views, self.batch_keys, self._get_chunk)
        with self._lock:
            self._counters["hits"] += done
            self._counters["bytes_read"] += done * self.record_bytes
            self._counters["misses"] += done < len(keys)
        return done

    def put_many(
        self, keys: Sequence[bytes], datas: Sequence, positions: Sequence[int] | None = None
    ) -> list[bool]:
        """Store blocks as records; stored, per key (full store, master gone: False)."""
        views = [memoryview(d).cast("B") for d in datas]
        stored = [False] * len(keys)
        for start in range(0, 0 if self._is_down() else len(keys), self.batch_keys):
            idx = [
                i
                for i in range(start, min(start + self.batch_keys, len(keys)))
                if views[i].nbytes == self.block_bytes
            ]
            if not idx:
                continue
            staging = self._staging(len(idx))
            h = block_record.HEADER_SIZE
            for row, i in enumerate(idx):
                rec = memoryview(staging[row])
                rec[h:] = views[i]
                rec[:h] = block_record.encode_header(self.namespace.id, keys[i], rec[h:])
            rcs = self._store.batch_put_from(
                [self.object_key(keys[i]) for i in idx],
                [staging[row].ctypes.data for row in range(len(idx))],
                [self.record_bytes] * len(idx),
            )
            for i, rc in zip(idx, rcs):
                stored[i] = rc == 0
            if RPC_FAIL in rcs or (any(rcs) and self._store.health_check() != 0):
                self._fault(f"put returned {sorted(set(rcs) - {0})}")
                break
            if any(rcs):  # a full store: failed writes, not a fault
                logger.debug("Mooncake Store put failed: %s", sorted(set(rcs) - {0}))
            else:
                self._ok()
        n = sum(stored)
        with self._lock:
            self._counters["bytes_written"] += n * self.record_bytes
            self._counters["failed_writes"] += len(keys) - n
        return stored

    def remove(self, key: bytes) -> bool:
        # force: a recent get holds a read lease (default 10 s) that would refuse the removal.
        return self._store.remove(self.object_key(key), True) == 0

    def clear(self) -> int:
        """Every object of this namespace (other namespaces' objects stay)."""
        n = self._store.remove_by_regex(f"^{self._prefix}", True)
        return max(n, 0)

    def stats(self) -> dict:
        with self._lock:
            out = dict(self._counters)
        # The store does not count objects per namespace; these are the client's own figures.
        out.update(blocks=0, capacity_blocks=0, healthy=self._store.health_check() == 0)
        return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            buffers, self._buffers = self._buffers, []
        for buf in buffers:
            self._store.unregister_buffer(buf.ctypes.data)
        self._store.close()

    # -- internals ---------------------------------------------------------------------------------

    def _get_chunk(self, keys: Sequence[bytes], outs: list[memoryview]) -> int:
        if self._is_down():
            return 0
        staging = self._staging(len(keys))
        okeys = [self.object_key(k) for k in keys]
        sizes = self._store.batch_get_into(
            okeys,
            [staging[row].ctypes.data for row in range(len(keys))],
            [self.record_bytes] * len(keys),
        )
        for row, (key, out, n) in enumerate(zip(keys, outs, sizes)):
            if n == OBJECT_NOT_FOUND:
                self._ok()
                return row
            if n < 0 and n != INVALID_PARAMS:
                self._fault(f"get returned {n}")
                return row
            payload = None
            if n > 0:
                payload = block_record.decode_and_verify(
                    self.namespace.id, key, memoryview(staging[row])[:n]
                )
            if payload is None:  # another size, foreign or corrupt: never used, removed
                logger.warning(
                    "Mooncake Store object %s is not a block record; removed", okeys[row]
                )
                self._store.remove(okeys[row], True)
                self._bump("failed_reads", False)
                return row
            out[:] = payload
        return len(keys)

    def _staging(self, rows: int) -> np.ndarray:
        """This thread's record buffers (``rows`` records at least), registered with the client
        for zero-copy transfers."""
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < rows:
            if buf is not None:
                self._store.unregister_buffer(buf.ctypes.data)
                with self._lock:
                    self._buffers = [b for b in self._buffers if b is not buf]
            buf = np.empty((max(rows, 1), self.record_bytes), dtype=np.uint8)
            rc = self._store.register_buffer(buf.ctypes.data, buf.nbytes)
            if rc != 0:
                raise RuntimeError(f"Mooncake Store: registering a staging buffer failed ({rc})")
            with self._lock:
                self._buffers.append(buf)
            self._local.buf = buf
        return buf

    def _is_down(self) -> bool:
        return self._failures > 0 and time.monotonic() < self._down_until

    def _fault(self, what: str) -> None:
        """The store did not answer: one warning per outage, then calls fail at once for a
        back-off period, after which one call tries again."""
        with self._lock:
            backoff = _BACKOFF_S[min(self._failures, len(_BACKOFF_S) - 1)]
            self._down_until = time.monotonic() + backoff
            first = self._failures == 0
            self._failures += 1
            self._counters["faults"] += 1
        if first:
            logger.warning(
                "Mooncake Store at %s does not answer (%s): reads miss and writes fail until "
                "it is back",
                self.spec.master,
                what,
            )

    def _ok(self) -> None:
        if self._failures:
            with self._lock:
                self._failures = 0
            logger.warning("Mooncake Store at %s is back", self.spec.master)

    def _bump(self, name: str, result: bool) -> bool:
        with self._lock:
            self._counters[name] += 1
        return result


class MemoryLender:
    """A store member that lends ``segment`` bytes of this process's memory until close()."""

    def __init__(self, spec) -> None:
        if spec.segment <= 0:
            raise ValueError(
                "lending memory to the Mooncake Store needs &segment=SIZE in the URL, e.g. "
                "mooncake://HOST:RPC_PORT?metadata=URL&segment=4GiB"
            )
        self.spec = spec
        self._store = _setup(spec, spec.segment, spec.buffer)
        logger.info("lending %d bytes to the Mooncake Store at %s", spec.segment, spec.master)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


def lend_memory(spec) -> MemoryLender:
    return MemoryLender(spec)
