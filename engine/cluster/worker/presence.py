"""A worker's presence to its router, whatever its role: who it is and where its peers reach it
(``Register``, sent when it starts and again every REGISTER_EVERY_S, so a restarted router finds
its workers), that it lives (``Heartbeat``: state, queues, KV usage and the role's own figures,
every ``heartbeat_s`` from a thread and a DEALER socket of their own, so a long forward never
looks like a death), and what its prefix cache holds (block events, the pool service's format, on
a PUB socket the router subscribes to for cache-aware placement).

The role's part of each message comes from the role (``Role.registration``, ``Role.heartbeat``).
The worker's main thread sends the registration on its control socket and publishes the block
events between engine steps; the engine's block pool reports them (``on_block``) on that thread.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable

import zmq

from engine.cluster import messages as m
from engine.cluster.transfer import shm_proof
from engine.cluster.worker.roles import Role
from engine.cluster.worker.worker_config import WorkerConfig
from engine.core.llm_engine import LLMEngine
from engine.ipc import curve
from engine.ipc.liveness import watch_peer
from engine.kvstore.block_events import EVENT_KEYS, BlockEvent

REGISTER_EVERY_S = 5.0  # registration repeated, so a restarted router finds its workers


class Presence:
    def __init__(self, ctx: zmq.Context, cfg: WorkerConfig, worker_id: str) -> None:
        self.ctx = ctx
        self.cfg = cfg
        self.worker_id = worker_id
        self.engine: LLMEngine | None = None  # attach()
        self.role: Role | None = None
        self.namespace = ""  # the pool's namespace of the engine's blocks, hex (attach())
        self._block_events: list[tuple[str, bytes]] = []
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 10_000)
        curve.secure_server(self._pub, f"tcp://{cfg.kv_host}:0")
        self._pub.bind(f"tcp://{cfg.kv_host}:0")
        self.events_address = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._next_register = 0.0
        self._stop = threading.Event()
        self._heartbeats: threading.Thread | None = None

    def on_block(self, kind: str, key: bytes) -> None:
        """The engine's block listener: a block stored or removed (published at the next
        ``publish_block_events``)."""
        self._block_events.append((kind, key))

    def attach(self, engine: LLMEngine, role: Role) -> None:
        """The worker's engine and role, once built: what the messages tell of."""
        self.engine, self.role = engine, role
        self.namespace = _namespace_hex(engine)

    # -- registration -----------------------------------------------------------------------

    def register(self) -> m.Register:
        """The worker's registration; the next is due REGISTER_EVERY_S from now."""
        self._next_register = time.monotonic() + REGISTER_EVERY_S
        cfg, e = self.cfg, self.engine
        return m.Register(
            worker_id=self.worker_id,
            role=cfg.role,
            pid=os.getpid(),
            model=str(e.model_path),
            max_model_len=e.max_model_len,
            transport=cfg.transport,
            host=socket.gethostname(),
            events_address=self.events_address,
            pid_ns=shm_proof.pid_namespace(),
            group=cfg.group,
            stage=cfg.stage.index,
            stages=cfg.stage.count,
            **{"kv_address": "", "shm_path": "", **self.role.registration()},
        )

    def register_due(self, now: float) -> bool:
        return now >= self._next_register

    # -- heartbeats -------------------------------------------------------------------------

    def start(self, state: Callable[[], str]) -> None:
        """Heartbeats from now on, each with the worker's ``state()``, until ``stop``."""
        self._heartbeats = threading.Thread(
            target=self._heartbeat_loop, args=(state,), name="heartbeat", daemon=True
        )
        self._heartbeats.start()

    def stop(self) -> None:
        self._stop.set()
        if self._heartbeats is not None:
            self._heartbeats.join(timeout=2)

    def _heartbeat_loop(self, state: Callable[[], str]) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.setsockopt_string(zmq.IDENTITY, f"{self.worker_id}/hb")
        watch_peer(sock)  # back within seconds of a partition's end (liveness.py)
        curve.secure_client(sock)
        sock.connect(self.cfg.router)
        try:
            while not self._stop.wait(self.cfg.heartbeat_s):
                try:
                    sock.send_multipart(m.encode(self.heartbeat(state())), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the router is away; it will see us late or not at all
        finally:
            sock.close(linger=0)

    def heartbeat(self, state: str) -> m.Heartbeat:
        e = self.engine
        with e.metrics.lock:
            finished = dict(e.metrics.finished)
        return m.Heartbeat(
            worker_id=self.worker_id,
            state=state,
            running=len(e.scheduler.running),
            waiting=len(e.scheduler.waiting) + len(e.scheduler.loading),
            kv_usage=float(e.kv.usage()),
            used_blocks=int(e.kv.pool.counts().used),
            transfers=self.role.num_requests,
            finished=finished,
            spec=e.spec.stats.snapshot() if e.spec is not None else {},
            prefix_queries=int(e.kv.prefix_queries),
            prefix_hits=int(e.kv.prefix_hits),
            **self.role.heartbeat(),
        )

    # -- block events -----------------------------------------------------------------------

    def publish_block_events(self) -> None:
        """Stored/removed block hashes since the last call, in runs of one kind."""
        events, self._block_events = self._block_events, []
        i = 0
        while i < len(events):
            kind, keys = events[i][0], []
            while i < len(events) and events[i][0] == kind and len(keys) < EVENT_KEYS:
                keys.append(events[i][1])
                i += 1
            event = BlockEvent(kind, tuple(keys), self.worker_id, self.namespace)
            try:
                self._pub.send(event.to_wire(), zmq.NOBLOCK)
            except zmq.Again:
                pass  # subscribers treat the index as a hint

    def close(self) -> None:
        self._pub.close(linger=0)


def _namespace_hex(engine) -> str:
    """The pool's namespace of this engine's blocks, when the pool code is there."""
    try:
        from engine.kvstore.namespace import make_namespace
    except ImportError:
        return ""
    try:
        ns = make_namespace(engine.model_config, engine.model, engine.cache.kv.dtype,
                            engine.cache.block_size)  # fmt: skip
        return ns.id.hex()
    except Exception:  # never let the hint stop a worker
        return ""
