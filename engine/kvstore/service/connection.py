"""The client side of a pool service connection: sessions, deadlines, reconnection.

A ``PoolConnection`` says ``hello`` for one namespace and keeps what the service answered (a
``Session``: block size, lease length, frame limit, and the namespace's shared-memory arena,
mapped when this process is on the service's host, which it proves by reading the nonce the
service wrote in a segment of its own). Requests go over a ZeroMQ DEALER socket per calling thread
(the engine's loader and writer threads call at once; each thread's replies come back on its own
socket) and are matched to replies by id.

Faults: every wait has a deadline. When the service does not answer, the call returns None and
one warning is logged (one per outage). Then calls return None at once: while the socket is not
connected (a dead or restarting service; zmq reconnects in the background, and checking costs
nothing), and for a back-off period (0.5 s doubling to 5 s) after a service that was connected
let a deadline pass (a hung service or a dead host); in that case every thread's socket is also
replaced, so no request queued for it is delivered later. Once connected again, one call says
``hello`` and the session resumes; a restarted service answers ``unknown namespace`` to a
request without one, and the connection says hello again and remaps the new arena.

A request whose offsets are arena offsets names the arena of its session (``exchange`` builds it
from the session it is sent in and returns that session with the reply): a restarted service
refuses an arena not its own, even when another client's hello opened the namespace there again,
and the connection then says hello and maps the new one. Before, offsets of the new arena were
read through the old mapping (a chaos run's wrong answers).
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from engine.ipc import curve
from engine.ipc.shm_names import POOL_PREFIX, check_shm_name
from engine.kvstore.namespace import KVNamespace
from engine.kvstore.service import protocol as P

logger = logging.getLogger(__name__)

_SHM_DIR = "/dev/shm"  # POSIX shared memory on Linux (multiprocessing.shared_memory's names)
_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)


@dataclass
class Session:
    """What ``hello`` told us; replaced when the service restarts."""

    block_bytes: int
    lease_s: float
    max_frame_bytes: int
    arena: mmap.mmap | None  # None: TCP path
    arena_name: str  # the service's shm segment of the namespace ("" if none)


class PoolConnection:
    def __init__(
        self,
        address: str,
        namespace: KVNamespace,
        timeout: float = 2.0,
        force_tcp: bool = False,
        connect_timeout: float = 0.25,
    ) -> None:
        if timeout <= 0 or connect_timeout <= 0:
            raise ValueError(f"timeouts must be > 0, got {timeout}, {connect_timeout}")
        self.address = address if "://" in address else f"tcp://{address}"
        self.namespace = namespace
        self.block_bytes = namespace.block_bytes
        self.timeout = timeout
        self.connect_timeout = min(connect_timeout, timeout)
        self.force_tcp = force_tcp
        self.counters = {"timeouts": 0, "reconnects": 0}
        self._ctx = zmq.Context()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._sockets: list[zmq.Socket] = []
        self._session: Session | None = None
        self._epoch = 0  # bumped on every failure: each thread then replaces its socket
        self._down_until = 0.0
        self._failures = 0
        self._closed = False
        self._ids = iter(range(1, 2**62))

    @property
    def current(self) -> Session | None:
        """The session, if there is one now (never connects)."""
        return self._session

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sockets, self._sockets = self._sockets, []
            session, self._session = self._session, None
        for sock in sockets:
            sock.close(linger=0)
        self._ctx.term()
        if session is not None and session.arena is not None:
            try:
                session.arena.close()
            except BufferError:  # a copy in another thread still holds a view
                pass

    def session(self) -> Session | None:
        """The session, saying hello first if needed; None while the service is down."""
        session = self._session
        if session is not None or self._closed:
            return session
        if self._failures:
            if time.monotonic() < self._down_until:
                return None
            if not self._socket().poll(0, zmq.POLLOUT):
                return None  # zmq reconnects in the background; until it has, fail at once
        ns = self.namespace
        reply = self._request(
            lambda mid: P.Hello(
                id=mid,
                model_digest=ns.model_digest,
                dtype=ns.dtype,
                block_size=ns.block_size,
                num_layers=ns.num_layers,
                num_kv_heads=ns.num_kv_heads,
                head_dim=ns.head_dim,
                namespace=ns.id,
            )
        )
        if not isinstance(reply, P.HelloOk):
            if isinstance(reply, P.Error):  # the service refused us: a config error, say it
                logger.warning("pool service %s refused hello: %s", self.address, reply.error)
                self._mark_down(warn=False, backoff=True)
            return None
        if reply.block_bytes != self.block_bytes:
            logger.warning(
                "pool service %s: block_bytes %d != ours %d; not used",
                self.address,
                reply.block_bytes,
                self.block_bytes,
            )
            self._mark_down(warn=False, backoff=True)
            return None
        arena = None if self.force_tcp else _map_arena(reply)
        with self._lock:
            if self._failures:
                logger.warning("pool service %s is back", self.address)
                self.counters["reconnects"] += 1
            self._failures = 0
            self._session = Session(
                reply.block_bytes,
                reply.lease_ms / 1000,
                reply.max_frame_bytes,
                arena,
                reply.shm_name,
            )
            return self._session

    def call(self, make: Callable[[int], P.Message]) -> P.Message | None:
        """Send the request ``make(id)`` in a session; its reply, or None (down, timed out)."""
        answered = self.exchange(lambda mid, _session: make(mid))
        return None if answered is None else answered[1]

    def exchange(
        self, make: Callable[[int, Session], P.Message]
    ) -> tuple[Session, P.Message] | None:
        """Send the request ``make(id, session)`` in a session (it names the session's arena
        when it carries arena offsets); that session and the reply, or None (down, timed
        out)."""
        for _ in range(2):
            session = self.session()
            if session is None:
                return None
            reply = self._request(lambda mid, s=session: make(mid, s))
            if isinstance(reply, P.Error) and reply.error.endswith("send hello first"):
                # The service restarted (a new process knows no namespaces, or holds another
                # arena): hello again, once.
                with self._lock:
                    if self._session is session:
                        self._session = None
                continue
            if reply is None:
                return None
            if isinstance(reply, P.Error):
                logger.debug("pool service error: %s", reply.error)
            return session, reply
        return None

    def _request(self, make):
        if self._closed:
            return None
        sock = self._socket()
        msg_id = next(self._ids)
        deadline = time.monotonic() + self.timeout
        try:
            if not sock.poll(self.connect_timeout * 1000, zmq.POLLOUT):
                return self._mark_down(backoff=False)  # not connected: nothing was sent
            sock.send_multipart(P.encode(make(msg_id)), zmq.NOBLOCK, copy=False)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(left * 1000, zmq.POLLIN):
                    self._bump_counter("timeouts")
                    return self._mark_down(backoff=True, new_socket=True)
                frames = sock.recv_multipart(copy=False)
                try:
                    reply = P.decode(frames)
                except P.ProtocolError as exc:
                    logger.warning("pool service sent a malformed reply: %s", exc)
                    continue
                if reply.id == msg_id:  # others are late replies to calls that gave up
                    return reply
        except zmq.ZMQError as exc:
            if self._closed:
                return None
            logger.debug("pool client socket error: %s", exc)
            return self._mark_down(backoff=True, new_socket=True)

    def send_only(self, msg: P.Message) -> None:
        """Fire and forget (release, abort): the service's reply is dropped as a late one."""
        try:
            self._socket().send_multipart(P.encode(msg), zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            pass  # the service ends the lease or reservation at its deadline

    def _socket(self) -> zmq.Socket:
        local = self._local
        sock = getattr(local, "sock", None)
        if sock is not None and local.epoch == self._epoch:
            return sock
        if sock is not None:  # discards requests queued for a service that stopped answering
            with self._lock:
                if sock in self._sockets:
                    self._sockets.remove(sock)
            sock.close(linger=0)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a peer that is not connected
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
        sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_FRAME_BYTES + 4096)
        curve.secure_client(sock)
        sock.connect(self.address)
        with self._lock:
            self._sockets.append(sock)
        local.sock, local.epoch = sock, self._epoch
        return sock

    def _mark_down(self, backoff: bool, new_socket: bool = False, warn: bool = True) -> None:
        """The service did not answer. ``backoff``: calls fail at once for a while (it accepted
        a connection but did not answer, or refused us); else only until zmq reconnects, which
        costs nothing to check. ``new_socket``: a request may be queued or in flight; every
        thread replaces its socket, so it is never delivered to the next service."""
        with self._lock:
            if new_socket:
                self._epoch += 1
            self._session = None
            delay = _BACKOFF_S[min(self._failures, len(_BACKOFF_S) - 1)] if backoff else 0.0
            self._down_until = time.monotonic() + delay
            first = self._failures == 0
            self._failures += 1
        if first and warn:
            logger.warning(
                "pool service %s does not answer (deadline %.1fs): pool reads miss and writes "
                "fail until it is back",
                self.address,
                self.timeout,
            )
        return None

    def _bump_counter(self, name: str) -> None:
        with self._lock:
            self.counters[name] += 1


def _map_arena(hello: P.HelloOk) -> mmap.mmap | None:
    """The namespace's arena, mapped read-write, if this process is on the service's host."""
    if not hello.shm_name or not hello.nonce_shm or hello.arena_bytes <= 0:
        return None
    try:
        # Names from a socket: ours (prefix, no path separators) or no mapping at all.
        check_shm_name(hello.nonce_shm, POOL_PREFIX)
        check_shm_name(hello.shm_name, POOL_PREFIX)
        with open(os.path.join(_SHM_DIR, hello.nonce_shm), "rb") as f:
            if f.read(len(hello.nonce)) != hello.nonce:
                return None  # a segment of that name, but another host's (or a stale) service
        fd = os.open(os.path.join(_SHM_DIR, hello.shm_name), os.O_RDWR)
        try:
            if os.fstat(fd).st_size < hello.arena_bytes:
                return None
            return mmap.mmap(fd, hello.arena_bytes)
        finally:
            os.close(fd)
    except (OSError, ValueError):
        return None
