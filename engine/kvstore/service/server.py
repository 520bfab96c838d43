"""The pool service: one process per host lends its DRAM and SSD to every engine that reaches it.

``engine pool serve --dram SIZE --ssd PATH:SIZE --port N [--events-port M]`` (engine/cli/pool.py)
runs a ``PoolService``: a ZeroMQ ROUTER socket speaking protocol.py, and one BlockStore per
namespace a client announces in ``hello`` (each with a DRAM arena of ``--dram`` and the SSD tier's
``PATH/<namespace hex>/`` of ``--ssd``: sizes are per namespace, and at most ``max_namespaces``
are kept). Engines on the host copy blocks through the namespace's shared-memory arena; engines
on other hosts get raw frames.

Threads: the main thread owns the sockets (receive, send, lease deadlines); ``workers`` threads
run the store operations, fed by a bounded queue (when it is full a request is answered
``error: busy`` at once) and handing replies back through an inproc socket. A reply that cannot
be sent at once (the peer is gone or its queue is full) is dropped: the client's deadline covers
it. SIGTERM/SIGINT: stop, close the stores (the arenas are unlinked), exit 0.

Events (a ZeroMQ PUB socket on ``--events-port``; cluster workers publish the same format): block
events (engine/kvstore/block_events.py) with ``source`` ``pool@HOST:PORT``. ``stored``: the keys
are in the pool now (put or committed). ``removed``: they left it (removed, cleared, or evicted
from the last local tier; a DRAM eviction that lands on the SSD is no removal). Subscribers may
miss events (PUB drops for slow or late subscribers): an index built from them is a hint,
confirmed by ``exists``.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from multiprocessing import shared_memory

import zmq

from engine.ipc import curve
from engine.kvstore.block_events import batches
from engine.kvstore.dram_tier import SHM_PREFIX, remove_orphan_arenas
from engine.kvstore.service import protocol as P
from engine.kvstore.service.namespaces import NamespaceStore, NamespaceTable

logger = logging.getLogger("engine.kvstore.service.server")

SEND_HWM = 10_000
_REPLIES = "inproc://pool-replies"


@dataclass(frozen=True)
class PoolServiceConfig:
    port: int
    dram_bytes: int = 0
    ssd_path: str | None = None
    ssd_bytes: int = 0
    host: str = "127.0.0.1"
    events_port: int | None = None
    policy: str = "lru"
    lease_s: float = 10.0  # shm leases and reservations end after this (a dead client's pins)
    max_namespaces: int = 4
    workers: int = 2
    max_queue: int = 1024  # requests waiting for a worker
    max_frame_bytes: int = P.MAX_FRAME_BYTES
    max_reply_bytes: int = 256 << 20  # inline bytes in one get_ok (the rest: ask again)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.events_port is not None and not 0 <= self.events_port < 65536:
            raise ValueError(f"events_port must be in [0, 65535], got {self.events_port}")
        if self.dram_bytes <= 0 and (self.ssd_path is None or self.ssd_bytes <= 0):
            raise ValueError("the pool needs a DRAM size > 0 or an SSD PATH:SIZE with SIZE > 0")
        if self.ssd_path is not None and self.ssd_bytes <= 0:
            raise ValueError(f"ssd size must be > 0, got {self.ssd_bytes}")
        for name in ("lease_s", "max_namespaces", "workers", "max_queue", "max_frame_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_frame_bytes > P.MAX_FRAME_BYTES:
            raise ValueError(f"max_frame_bytes must be <= {P.MAX_FRAME_BYTES}")


class PoolService:
    def __init__(self, config: PoolServiceConfig) -> None:
        self.config = config
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a vanished peer raises, not blocks
        self._router.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._router.setsockopt(zmq.RCVHWM, SEND_HWM)
        # A frame over the limit closes that peer's connection before it is buffered.
        self._router.setsockopt(zmq.MAXMSGSIZE, config.max_frame_bytes + 4096)
        curve.secure_server(self._router, f"tcp://{config.host}:{config.port}")
        self._router.bind(f"tcp://{config.host}:{config.port}")
        endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(endpoint.rsplit(":", 1)[1])
        self.source = f"pool@{config.host}:{self.port}"
        self._pub = None
        self.events_port = None
        if config.events_port is not None:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._pub.setsockopt(zmq.SNDHWM, SEND_HWM)
            curve.secure_server(self._pub, f"tcp://{config.host}:{config.events_port}")
            self._pub.bind(f"tcp://{config.host}:{config.events_port}")
            ep = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self.events_port = int(ep.rsplit(":", 1)[1])
        self._pub_lock = threading.Lock()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(_REPLIES)
        self._work: queue.Queue = queue.Queue(maxsize=config.max_queue)
        # A segment holding a random nonce: a client that maps it and reads the nonce is on this
        # host, so it can map the arenas too.
        self.nonce = os.urandom(16)
        remove_orphan_arenas()  # a predecessor's, SIGKILLed: its nonce and arenas
        self._nonce_shm = shared_memory.SharedMemory(  # named as the arenas: <prefix><pid>-
            name=f"{SHM_PREFIX}{os.getpid()}-nonce{uuid.uuid4().hex[:12]}",
            create=True,
            size=len(self.nonce),
        )
        self._nonce_shm.buf[: len(self.nonce)] = self.nonce
        self.table = NamespaceTable(config, self._publish)
        self._threads = [
            threading.Thread(target=self._worker, name=f"pool-worker-{i}", daemon=True)
            for i in range(config.workers)
        ]

    # -- lifecycle ---------------------------------------------------------------------------------

    def request_stop(self, *_args) -> None:
        self._stop.set()

    def serve(self, install_signals: bool = True) -> None:
        """Serve until request_stop() (or SIGTERM/SIGINT when install_signals), then clean up."""
        if install_signals:
            signal.signal(signal.SIGTERM, self.request_stop)
            signal.signal(signal.SIGINT, self.request_stop)
        for t in self._threads:
            t.start()
        logger.info("pool service on tcp://%s:%d", self.config.host, self.port)
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        next_expiry = 0.0
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(100))
                if self._pull in ready:
                    self._send_replies()
                if self._router in ready:
                    self._receive()
                now = time.monotonic()
                if now >= next_expiry:  # a scan of the leases, at most 20 times a second
                    self.table.expire(now)
                    next_expiry = now + 0.05
        finally:
            self.close()

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=5.0)
        self.table.close()
        for sock in (self._router, self._pull, self._pub):
            if sock is not None:
                sock.close(linger=0)
        curve.stop_authenticator(self._ctx)
        self._ctx.term()
        try:
            self._nonce_shm.close()
            self._nonce_shm.unlink()
        except FileNotFoundError:
            pass

    # -- socket IO (main thread) -------------------------------------------------------------------

    def _receive(self) -> None:
        for _ in range(256):  # bounded, so replies and lease deadlines get their turn
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue  # no header: nothing to answer
            peer = frames[0].bytes
            try:
                msg = self._decode(frames[1:])
            except P.ProtocolError as exc:
                self._reply_now(peer, P.Error(error=str(exc)))
                continue
            if self._cheap(msg):  # no disk, no copy: answered here, saving two thread hops
                self._reply_now(peer, self._execute(peer, msg))
                continue
            try:
                self._work.put_nowait((peer, msg))
            except queue.Full:
                self._reply_now(peer, P.Error(id=msg.id, error="busy: the request queue is full"))

    def _cheap(self, msg: P.Message) -> bool:
        """Requests that touch only in-memory state (indexes, leases, reservations)."""
        if isinstance(msg, P.Exists | P.Release | P.Commit | P.Abort):
            return True
        if isinstance(msg, P.Get | P.Reserve):
            store = self.table.get(msg.namespace)
            if store is None or store.dram is None:
                return False
            if isinstance(msg, P.Reserve):
                return store.ssd is None  # else an eviction may demote a block to disk
            return msg.shm and all(store.dram.contains(k) for k in msg.keys)
        return False

    def _send_replies(self) -> None:
        for _ in range(256):
            try:
                frames = self._pull.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._send(frames)

    def _reply_now(self, peer: bytes, msg: P.Message) -> None:
        self._send([peer, *P.encode(msg)])

    def _send(self, frames: list) -> None:
        try:
            self._router.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except (zmq.Again, zmq.ZMQError):  # peer gone or not reading: its deadline covers it
            pass

    # -- workers -----------------------------------------------------------------------------------

    def _worker(self) -> None:
        push = self._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(_REPLIES)
        try:
            while not self._stop.is_set():
                try:
                    peer, msg = self._work.get(timeout=0.1)
                except queue.Empty:
                    continue
                reply = self._execute(peer, msg)
                push.send_multipart([peer, *P.encode(reply)], copy=False)
        finally:
            push.close(linger=0)

    def _decode(self, frames: list) -> P.Message:
        msg = P.decode(frames)
        for frame in getattr(msg, "frames", ()):
            if frame.nbytes > self.config.max_frame_bytes:
                raise P.ProtocolError(
                    f"{msg.OP}: a data frame of {frame.nbytes} bytes exceeds the limit "
                    f"{self.config.max_frame_bytes}"
                )
        if not isinstance(msg, P.REQUESTS):
            raise P.ProtocolError(f"{msg.OP} is a reply, not a request")
        return msg

    def _execute(self, peer: bytes, msg: P.Message) -> P.Message:
        try:
            if isinstance(msg, P.Hello):
                return self._hello(msg)
            if isinstance(msg, P.Clear | P.Stats):
                return self._all_namespaces(msg)
            store = self.table.get(msg.namespace)
            if store is None:
                raise P.ProtocolError(
                    f"{msg.OP}: unknown namespace {msg.namespace.hex()}: send hello first"
                )
            _check_arena(store, msg)
            return self._namespace_op(store, peer, msg)
        except P.ProtocolError as exc:
            return P.Error(id=msg.id, error=str(exc))
        except Exception as exc:  # a bug must cost one reply, never the service
            logger.exception("pool service: request failed")
            return P.Error(id=msg.id, error=f"internal error: {type(exc).__name__}: {exc}")

    def _hello(self, msg: P.Hello) -> P.Message:
        if msg.version != P.PROTOCOL_VERSION:
            raise P.ProtocolError(f"hello: version must be {P.PROTOCOL_VERSION}, got {msg.version}")
        store = self.table.open(msg)
        dram = store.dram
        return P.HelloOk(
            id=msg.id,
            block_bytes=store.namespace.block_bytes,
            shm_name="" if dram is None else dram.shm_name,
            arena_bytes=0 if dram is None else dram.arena_bytes,
            nonce_shm=self._nonce_shm.name,
            nonce=self.nonce,
            lease_ms=int(self.config.lease_s * 1000),
            max_frame_bytes=self.config.max_frame_bytes,
            source=self.source,
        )

    def _all_namespaces(self, msg: P.Clear | P.Stats) -> P.Message:
        stores = self.table.select(msg.namespace)
        if isinstance(msg, P.Clear):
            return P.CountOk(id=msg.id, count=sum(s.clear() for s in stores))
        stats = {s.namespace.id.hex(): s.stats() for s in stores}
        return P.StatsOk(id=msg.id, stats={"service": self._service_stats(), **stats})

    def _service_stats(self) -> dict:
        return {
            "source": self.source,
            "events_port": self.events_port,  # None: no events (a router's --kv-pool asks)
            "namespaces": len(self.table),
            "queued": self._work.qsize(),
            "leases": self.table.num_leases(),
        }

    def _namespace_op(self, store: NamespaceStore, peer: bytes, msg: P.Message) -> P.Message:
        if isinstance(msg, P.Exists):
            return P.ExistsOk(id=msg.id, matched=store.store.match(msg.keys))
        if isinstance(msg, P.Get):
            offsets, frames, sums = store.get(
                peer, msg.keys, msg.shm, self.config.max_reply_bytes, time.monotonic()
            )
            return P.GetOk(id=msg.id, offsets=offsets, checksums=sums, frames=tuple(frames))
        if isinstance(msg, P.Release):
            store.release(peer, msg.keys)
            return P.Ack(id=msg.id)
        if isinstance(msg, P.Put):
            return P.PutOk(id=msg.id, stored=store.put(msg.keys, msg.positions, msg.frames))
        if isinstance(msg, P.Reserve):
            offsets = store.reserve(peer, msg.keys, msg.positions, time.monotonic())
            return P.ReserveOk(id=msg.id, offsets=offsets)
        if isinstance(msg, P.Commit):
            if msg.checksums and len(msg.checksums) != len(msg.keys):
                raise P.ProtocolError(
                    f"commit: checksums has {len(msg.checksums)} items, keys has {len(msg.keys)}"
                )
            return P.PutOk(id=msg.id, stored=store.commit(peer, msg.keys, msg.checksums))
        if isinstance(msg, P.Abort):
            store.abort(peer, msg.keys)
            return P.Ack(id=msg.id)
        if isinstance(msg, P.Remove):
            return P.CountOk(id=msg.id, count=store.remove(msg.keys))
        raise P.ProtocolError(f"{msg.OP}: not handled")

    # -- events ------------------------------------------------------------------------------------

    def _publish(self, kind: str, namespace: bytes, keys: list[bytes]) -> None:
        if self._pub is None:
            return
        for event in batches(kind, keys, self.source, namespace.hex()):
            with self._pub_lock:
                try:
                    self._pub.send(event.to_wire(), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass  # no subscriber keeps up: events are hints


def _check_arena(store: NamespaceStore, msg: P.Message) -> None:
    """A request whose offsets are arena offsets must name this namespace's arena: a client
    that mapped another one (this service's predecessor's) would read or write other bytes."""
    if isinstance(msg, P.Get) and not msg.shm:
        return
    if isinstance(msg, P.Get | P.Reserve | P.Commit):
        ours = "" if store.dram is None else store.dram.shm_name
        if msg.arena != ours:
            raise P.ProtocolError(
                f"{msg.OP}: arena {msg.arena[:80]!r} is not this service's ({ours!r}; it "
                "restarted): send hello first"
            )
