"""The pool service as a tier of an engine's block store (``tcp://HOST:PORT`` in ``--kv-pool``).

``PoolClientTier`` speaks service/protocol.py through a ``PoolConnection`` (service/connection.py:
sessions, deadlines, one warning per outage, reconnection). On the service's host blocks move
through the namespace's shared-memory arena (the socket carries keys and offsets), elsewhere as
raw records over TCP (``force_tcp`` forces that, for tests and benchmarks); records received over
TCP are verified (namespace, key, length, checksum), a bad one is a miss.

Batches: ``get_many_into`` and ``put_many`` move several blocks per round trip
(``get_into``/``put`` are batches of one). A dead service makes reads miss and writes fail; it
never raises.

Shared-memory writes are two-phase (reserve slots, copy, commit), and a copy into or out of a
slot is only trusted when it finished well inside the service's lease (half of it): after the
lease the service may hand the slot to another block.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from engine.kvstore import block_record
from engine.kvstore.namespace import KVNamespace
from engine.kvstore.service import protocol as P
from engine.kvstore.service.connection import PoolConnection, Session
from engine.kvstore.tier import PutResult, Tier, block_views, read_prefix

logger = logging.getLogger(__name__)

# Blocks per round trip. Through the arena a message carries only keys and offsets; over TCP a
# few MiB per message, since multi-MiB messages through ZeroMQ ran at half the rate of
# block-sized ones here (the data no longer stays in cache between the copies).
SHM_BATCH_BYTES = 64 << 20
TCP_BATCH_BYTES = 4 << 20


class PoolClientTier(Tier):
    name = "remote"

    def __init__(
        self,
        address: str,
        namespace: KVNamespace,
        timeout: float = 2.0,
        force_tcp: bool = False,
        connect_timeout: float = 0.25,
    ) -> None:
        self.namespace = namespace
        self.block_bytes = namespace.block_bytes
        self.force_tcp = force_tcp
        record_bytes = block_record.HEADER_SIZE + self.block_bytes
        self._batch = {
            True: max(1, min(P.MAX_KEYS, SHM_BATCH_BYTES // record_bytes)),
            False: max(1, min(P.MAX_KEYS, TCP_BATCH_BYTES // record_bytes)),
        }
        self._conn = PoolConnection(address, namespace, timeout, force_tcp, connect_timeout)
        self.address = self._conn.address
        self._lock = threading.Lock()
        self._counters = dict.fromkeys(
            ("hits", "misses", "bytes_read", "bytes_written", "evictions", "failed_reads"), 0
        )
        self._counters.update(failed_writes=0, refused=0)

    # -- the Tier contract -------------------------------------------------------------------------

    @property
    def same_host(self) -> bool:
        session = self._conn.current
        return session is not None and session.arena is not None

    @property
    def reconnects(self) -> int:
        """Sessions started after an outage (no I/O). The pool may have lost blocks meanwhile
        (a restarted service starts empty but for its SSD): callers that remember what the
        pool holds should forget it when this changes."""
        return self._conn.counters["reconnects"]

    @property
    def arena_name(self) -> str | None:
        """The service's shared-memory segment for our namespace, once connected."""
        session = self._conn.session()
        return None if session is None else session.arena_name

    def contains(self, key: bytes) -> bool:
        return self.match_prefix([key]) == 1

    def match_prefix(self, keys) -> int:
        """How many leading keys the pool holds: one round trip per ``MAX_KEYS`` keys."""
        matched = 0
        for i in range(0, len(keys), P.MAX_KEYS):
            chunk = list(keys[i : i + P.MAX_KEYS])
            reply = self._conn.call(
                lambda mid, c=chunk: P.Exists(id=mid, namespace=self._ns, keys=c)
            )
            n = reply.matched if isinstance(reply, P.ExistsOk) else 0
            matched += n
            if n < len(chunk):
                break
        return matched

    def get_into(self, key: bytes, out: memoryview) -> bool:
        return self.get_many_into([key], [out]) == 1

    def put(self, key: bytes, data: memoryview, position: int = 0) -> PutResult:
        return PutResult(self.put_many([key], [data], [position])[0], [])

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence) -> int:
        """Copy the leading blocks of ``keys`` the pool holds into ``outs`` (each exactly
        block_bytes); how many (a prefix)."""
        views = block_views(outs, self.block_bytes)
        session = self._conn.session()
        batch = self._batch[session is not None and session.arena is not None]
        done = read_prefix(keys, views, batch, self._get_chunk)
        with self._lock:
            self._counters["hits"] += done
            self._counters["bytes_read"] += done * self.block_bytes
            self._counters["misses"] += done < len(keys)
        return done

    def put_many(
        self, keys: Sequence[bytes], datas: Sequence, positions: Sequence[int] | None = None
    ) -> list[bool]:
        """Store blocks; stored, per key (False: wrong size, refused, no room, service down)."""
        positions = list(positions) if positions is not None else [0] * len(keys)
        views = [memoryview(d).cast("B") for d in datas]
        stored = [False] * len(keys)
        session = self._conn.session()
        batch = self._batch[session is not None and session.arena is not None]
        for start in range(0, len(keys) if session is not None else 0, batch):
            idx = [
                i
                for i in range(start, min(start + batch, len(keys)))
                if views[i].nbytes == self.block_bytes
            ]
            if not idx:
                continue
            put = self._put_shm if session.arena is not None else self._put_tcp
            ok = put(
                session,
                [keys[i] for i in idx],
                [views[i] for i in idx],
                [positions[i] for i in idx],
            )
            for i, s in zip(idx, ok):
                stored[i] = s
        n = sum(stored)
        with self._lock:
            self._counters["bytes_written"] += n * self.block_bytes
            self._counters["failed_writes"] += len(keys) - n
        return stored

    def remove(self, key: bytes) -> bool:
        reply = self._conn.call(lambda mid: P.Remove(id=mid, namespace=self._ns, keys=[key]))
        return isinstance(reply, P.CountOk) and reply.count > 0

    def clear(self) -> int:
        reply = self._conn.call(lambda mid: P.Clear(id=mid, namespace=self._ns))
        return reply.count if isinstance(reply, P.CountOk) else 0

    def stats(self) -> dict:
        with self._lock:
            out = dict(self._counters)
        out.update(self._conn.counters)
        out.update(blocks=0, capacity_blocks=0, connected=False, same_host=self.same_host)
        reply = self._conn.call(lambda mid: P.Stats(id=mid, namespace=self._ns))
        if isinstance(reply, P.StatsOk):
            tiers = reply.stats.get(self._ns.hex(), {}).get("tiers", {})
            out["blocks"] = sum(t.get("blocks", 0) for t in tiers.values())
            out["capacity_blocks"] = sum(t.get("capacity_blocks", 0) for t in tiers.values())
            out["evictions"] = sum(t.get("evictions", 0) for t in tiers.values())
            out["connected"] = True
            out["service"] = reply.stats
        return out

    def close(self) -> None:
        self._conn.close()

    # -- batches -----------------------------------------------------------------------------------

    def _get_chunk(self, keys: list[bytes], outs: list[memoryview]) -> int:
        session = self._conn.session()
        if session is None:
            return 0
        start = time.monotonic()
        answered = self._conn.exchange(
            lambda mid, s: P.Get(
                id=mid, namespace=self._ns, keys=keys, shm=s.arena is not None, arena=s.arena_name
            )
        )
        if answered is None or not isinstance(answered[1], P.GetOk):
            return 0
        # Offsets in the arena of the session the request named (and was answered in).
        session, reply = answered
        shm = session.arena is not None
        frames = iter(reply.frames)
        sums = list(reply.checksums) + [None] * (len(reply.offsets) - len(reply.checksums))
        leased = [k for k, off in zip(keys, reply.offsets) if off >= 0]
        first_leased = next((i for i, off in enumerate(reply.offsets) if off >= 0), None)
        n = 0
        for key, out, offset, expected in zip(keys, outs, reply.offsets, sums):
            if offset == P.INLINE:
                payload = block_record.decode_and_verify(self._ns, key, next(frames))
                if payload is None or payload.nbytes != out.nbytes:
                    self._bump("failed_reads")
                    break
                out[:] = payload
            elif shm and 0 <= offset <= len(session.arena) - out.nbytes:
                out[:] = memoryview(session.arena)[offset : offset + out.nbytes]
                if block_record.checksum(out) != expected:  # a slot rewritten under us
                    self._bump("failed_reads")
                    break
            else:
                self._bump("failed_reads")
                break
            n += 1
        if leased:
            self._conn.send_only(P.Release(namespace=self._ns, keys=leased))
            if time.monotonic() - start > session.lease_s / 2 and n > first_leased:
                self._bump("failed_reads")  # a lease may have ended under the copy
                n = first_leased
        return n

    def _put_shm(self, session: Session, keys, views, positions) -> list[bool]:
        start = time.monotonic()
        answered = self._conn.exchange(
            lambda mid, s: P.Reserve(
                id=mid, namespace=self._ns, keys=keys, positions=positions, arena=s.arena_name
            )
        )
        if answered is None or answered[0].arena is None:
            return [False] * len(keys)  # down, or it restarted off this host's memory
        session, reply = answered  # the slots are in this session's arena
        if not isinstance(reply, P.ReserveOk) or len(reply.offsets) != len(keys):
            return [False] * len(keys)
        stored = [offset == P.PRESENT for offset in reply.offsets]
        written: list[int] = []
        arena = memoryview(session.arena)
        for i, offset in enumerate(reply.offsets):
            if offset < 0:
                continue
            if offset > len(arena) - views[i].nbytes:
                continue  # never written, ended at the reservation's deadline
            if time.monotonic() - start > session.lease_s / 2:  # the reservation may be gone
                break
            arena[offset : offset + views[i].nbytes] = views[i]
            written.append(i)
        sums = {i: block_record.checksum(views[i]) for i in written}  # what the slots must hold
        done = set(written)
        unwritten = [keys[i] for i, o in enumerate(reply.offsets) if o >= 0 and i not in done]
        if unwritten:
            self._conn.send_only(P.Abort(namespace=self._ns, keys=unwritten))
        if written:
            commit = [keys[i] for i in written]
            arena_name = session.arena_name  # committed where written, or refused
            checks = [sums[i] for i in written]
            reply = self._conn.call(
                lambda mid: P.Commit(
                    id=mid, namespace=self._ns, keys=commit, arena=arena_name, checksums=checks
                )
            )
            if isinstance(reply, P.PutOk) and len(reply.stored) == len(written):
                for i, ok in zip(written, reply.stored):
                    stored[i] = ok
        return stored

    def _put_tcp(self, session: Session, keys, views, positions) -> list[bool]:
        size = block_record.HEADER_SIZE + self.block_bytes
        if size > session.max_frame_bytes:
            self._bump("refused")
            logger.warning(
                "pool client: a %d-byte record exceeds the frame limit %d; not sent",
                size,
                session.max_frame_bytes,
            )
            return [False] * len(keys)
        records = []
        for key, data in zip(keys, views):
            record = bytearray(size)
            record[: block_record.HEADER_SIZE] = block_record.encode_header(self._ns, key, data)
            record[block_record.HEADER_SIZE :] = data
            records.append(record)
        reply = self._conn.call(
            lambda mid: P.Put(
                id=mid, namespace=self._ns, keys=keys, positions=positions, frames=tuple(records)
            )
        )
        if isinstance(reply, P.PutOk) and len(reply.stored) == len(keys):
            return list(reply.stored)
        return [False] * len(keys)

    # -- internals -------------------------------------------------------------------------------

    @property
    def _ns(self) -> bytes:
        return self.namespace.id

    def _bump(self, name: str) -> None:
        with self._lock:
            self._counters[name] += 1
