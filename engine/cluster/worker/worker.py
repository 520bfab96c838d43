"""A worker process: ``engine worker --role prefill|decode --router tcp://H:P`` (and a prefill
group's stage: ``--group NAME --stage I/N``).

The worker runs any role the same way: the role (roles.py; one module a role) builds its engine
and owns what its role needs beyond it, takes the router's work for its role and the messages
only it knows, and says what the worker's loop and its presence need of it. The worker owns the
sockets to the router, the loop, and its presence (presence.py: registration, heartbeats, block
events).

Threads and sockets (each socket used by one thread only):

- the main thread owns the engine and the control DEALER to the router: between engine steps it
  takes router messages (without waiting while there is work), lets the role take its news and
  step the engine, and sends outputs;
- a heartbeat thread owns a second DEALER and reports state, queues and KV usage every
  ``heartbeat_s`` (so a long forward never looks like a death);
- decode: the KV receiver's thread owns the PULL socket prefill workers push KV to, and wakes
  the main thread through an inproc socket when a transfer ends;
- prefill: the KV sender's thread owns the PUSH sockets to decode workers;
- a group's stage: the hidden-state link's threads own its sockets (stage_link.py,
  hidden_receiver.py) and wake the main thread when rows come.

SIGTERM drains: the worker says "draining" (the router places nothing more here), finishes what
it holds, says goodbye and exits 0. A second SIGTERM exits at once.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import uuid

import zmq

from engine.cluster import messages as m
from engine.cluster.worker.presence import Presence
from engine.cluster.worker.roles import ROLE_MESSAGES, Role, WorkerSeams
from engine.cluster.worker.worker_config import WorkerConfig
from engine.config import EngineConfig
from engine.ipc import curve
from engine.ipc.liveness import watch_peer

log = logging.getLogger(__name__)


class Worker:
    def __init__(self, cfg: WorkerConfig) -> None:
        import torch

        torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.worker_id = cfg.worker_id or f"{cfg.role}-{uuid.uuid4().hex[:6]}"
        self.ctx = zmq.Context.instance()
        self._wake_addr = f"inproc://wake-{uuid.uuid4().hex}"
        self._wake_pull = self.ctx.socket(zmq.PULL)
        self._wake_pull.bind(self._wake_addr)
        self._wake_local = threading.local()
        self.state = "up"
        self._stop = threading.Event()
        self._outbox: list[m.Message] = []
        self.presence = Presence(self.ctx, cfg, self.worker_id)
        seams = WorkerSeams(self.ctx, self.worker_id, self._emit, self._wake, self._make_engine)
        self.role = role_type(cfg).for_worker(cfg, seams)
        self.engine = self.role.engine
        self.presence.attach(self.engine, self.role)

    def _make_engine(self, engine_cfg: EngineConfig, connector_factory, stage_io=None):
        """The role's engine with the worker's seams: its connector (the role's KV sender or
        receiver, wrapping the KV pool's connector the engine builds), the block pool's listener
        (block events published) and, on a group's stage, its hidden-state link."""
        from engine.core.llm_engine import LLMEngine

        return LLMEngine(
            engine_cfg,
            connector_factory=connector_factory,
            block_listener=self.presence.on_block,
            stage_io=stage_io,
        )

    # -- messaging --------------------------------------------------------------------------

    def _emit(self, msg: m.Message) -> None:
        self._outbox.append(msg)

    def _wake(self) -> None:
        """From any thread: interrupt the main thread's poll."""
        sock = getattr(self._wake_local, "sock", None)
        if sock is None:
            sock = self._wake_local.sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 1)
            sock.connect(self._wake_addr)
        try:
            sock.send(b"", zmq.NOBLOCK)
        except zmq.Again:
            pass  # a wake is pending already

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> int:
        ctl = self.ctx.socket(zmq.DEALER)
        ctl.setsockopt(zmq.LINGER, 2000)
        ctl.setsockopt(zmq.SNDHWM, 100_000)
        ctl.setsockopt(zmq.MAXMSGSIZE, m.MAX_HEADER_BYTES + 1024)
        ctl.setsockopt_string(zmq.IDENTITY, self.worker_id)
        watch_peer(ctl)
        curve.secure_client(ctl)
        ctl.connect(self.cfg.router)
        ctl.send_multipart(m.encode(self.presence.register()))
        self.presence.start(lambda: self.state)
        poller = zmq.Poller()
        poller.register(ctl, zmq.POLLIN)
        poller.register(self._wake_pull, zmq.POLLIN)
        for sock in self.role.sockets():
            poller.register(sock, zmq.POLLIN)
        log.info("%s worker %s up (router %s)", self.cfg.role, self.worker_id, self.cfg.router)
        stalled = False  # the last step ran nothing: its inputs (a stage's hidden states) wait
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                if self.state == "draining" and not busy and not self.role.num_requests:
                    break
                if self._stop.is_set():
                    break
                # A role whose requests wait for their inputs sleeps until they come (they wake
                # this poll), not spinning a core its peers need.
                events = dict(poller.poll(0 if busy and not stalled else 50))
                if ctl in events:
                    self._take_control(ctl)
                if self._wake_pull in events:
                    while True:
                        try:
                            self._wake_pull.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                self.role.poll(events, time.monotonic())
                stalled = False
                if self.engine.has_unfinished_requests():
                    stalled = self.role.step()
                if self.presence.register_due(time.monotonic()):  # a restarted router learns
                    self._emit(self.presence.register())
                self._flush(ctl)
            self._flush(ctl)
            ctl.send_multipart(m.encode(m.Goodbye(self.worker_id)))
            return 0
        finally:
            self._stop.set()
            self.presence.stop()
            self.close()
            ctl.close(linger=1000)

    def _take_control(self, ctl: zmq.Socket) -> None:
        for _ in range(1000):  # bounded: the engine gets its step between bursts
            try:
                frames = ctl.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = m.decode(frames)
            except m.MessageError as exc:
                log.warning("bad message from the router: %s", exc)
                continue
            if isinstance(msg, m.Abort):
                self.role.abort(msg.request_id)
            elif isinstance(msg, ROLE_MESSAGES):
                self.role.control(msg)
            elif isinstance(msg, (m.PrefillRequest, m.DecodeRequest)):
                if self.state != "up":
                    self._emit(m.RequestError(msg.request_id, self.worker_id, 503, "draining"))
                elif isinstance(msg, self.role.request_type):
                    self.role.handle(msg)
                else:
                    self._emit(m.RequestError(msg.request_id, self.worker_id, 500, "wrong role"))
            else:
                log.warning("unexpected %s from the router", msg.TYPE)

    def _flush(self, ctl: zmq.Socket) -> None:
        self.presence.publish_block_events()
        out, self._outbox = self._outbox, []
        for msg in out:
            try:
                ctl.send_multipart(m.encode(msg), zmq.NOBLOCK)
            except zmq.Again:
                log.error("router unreachable: dropped %s for %s", msg.TYPE, msg.request_id)

    def drain(self) -> None:
        """SIGTERM: take no new work, finish what is held, then exit."""
        if self.state == "draining":
            self._stop.set()  # a second signal: stop now
        self.state = "draining"
        self._wake()

    def close(self) -> None:
        self.role.close()
        self._wake_pull.close(linger=0)
        self.presence.close()


def role_type(cfg: WorkerConfig) -> type[Role]:
    """The role a worker's configuration runs: a stage of a prefill group, or a prefill or a
    decode worker alone."""
    if cfg.group:
        from engine.cluster.worker.stage_role import StageRole

        return StageRole
    if cfg.role == "prefill":
        from engine.cluster.worker.prefill_role import PrefillRole

        return PrefillRole
    from engine.cluster.worker.decode_role import DecodeRole

    return DecodeRole


def run_worker(cfg: WorkerConfig) -> int:
    worker = Worker(cfg)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.drain())
    return worker.run()
