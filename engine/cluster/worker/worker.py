"""A prefill or decode worker process: ``engine worker --role prefill|decode --router tcp://H:P``.

Threads and sockets (each socket used by one thread only):

- the main thread owns the engine and the control DEALER to the router: between engine steps it
  takes router messages (without waiting while there is work) and sends outputs;
- a heartbeat thread owns a second DEALER and reports state, queues and KV usage every
  ``heartbeat_s`` (so a long forward never looks like a death);
- decode: the KV receiver's thread owns the PULL socket prefill workers push KV to, and wakes
  the main thread through an inproc socket when a transfer ends;
- prefill: the KV sender's thread owns the PUSH sockets to decode workers.

SIGTERM drains: the worker says "draining" (the router places nothing more here), finishes what
it holds, says goodbye and exits 0. A second SIGTERM exits at once.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass

import zmq

from engine.cluster import messages as m
from engine.cluster.conductor.step_stats import StepStats
from engine.config import EngineConfig
from engine.ipc import curve
from engine.ipc.liveness import watch_peer
from engine.kv_connector import shm_proof
from engine.kvstore.block_events import EVENT_KEYS, BlockEvent
from engine.pipeline_stage import WHOLE_MODEL, PipelineStage

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
REGISTER_EVERY_S = 5.0  # registration repeated, so a restarted router finds its workers
TRANSPORTS = ("shm", "tcp", "mooncake")


@dataclass(frozen=True)
class WorkerConfig:
    role: str
    router: str  # the router's control endpoint, tcp://HOST:PORT
    engine: EngineConfig
    worker_id: str = ""
    transport: str = "shm"  # what this decode worker offers: shm (and tcp) or tcp only
    kv_host: str = "127.0.0.1"  # where every socket other hosts reach binds (KV, events, copies)
    kv_load_failure: str = "recompute"
    staging_mb: int = 1024
    heartbeat_s: float = 0.5
    threads: int = 1  # torch threads (several workers share a host's cores)
    mooncake_metadata: str = "P2PHANDSHAKE"  # Mooncake's metadata service, for mooncake
    # A stage of a pipelined prefill group (stage_role.py): the group's name and this stage
    # (``--group NAME --stage I/N``); "" and the whole model for a prefill worker alone.
    group: str = ""
    stage: PipelineStage = WHOLE_MODEL

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.stage, PipelineStage):
            raise ValueError(f"stage must be a PipelineStage, got {self.stage!r}")
        if bool(self.group) != (self.stage.count > 1):
            raise ValueError(
                "a prefill group's worker needs both --group NAME and --stage I/N (N >= 2), "
                f"got group {self.group!r} and stage {self.stage}"
            )
        if self.group and self.role != "prefill":
            raise ValueError(f"only prefill workers form groups, not {self.role!r}")
        if self.group and not (0 < len(self.group) <= 64 and self.group.isprintable()):
            raise ValueError(f"group must be a name of 1 to 64 characters, got {self.group!r}")
        if self.group and self.engine.kv_pool:
            raise ValueError("prefill groups run without a KV pool (--kv-pool)")
        if not self.router.startswith("tcp://"):
            raise ValueError(f"router must be a tcp:// address, got {self.router!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.kv_load_failure not in ("recompute", "fail"):
            raise ValueError(
                f"kv_load_failure must be recompute or fail, got {self.kv_load_failure!r}"
            )
        if self.staging_mb < 1:
            raise ValueError(f"kv_staging_mb must be >= 1, got {self.staging_mb}")
        if not 0.01 <= self.heartbeat_s <= 60:
            raise ValueError(f"heartbeat_s must be in [0.01, 60], got {self.heartbeat_s}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")


class Worker:
    def __init__(self, cfg: WorkerConfig) -> None:
        import torch

        from engine.core.llm_engine import LLMEngine

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
        self._block_events: list[tuple[str, bytes]] = []
        self._pub = self.ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 10_000)
        curve.secure_server(self._pub, f"tcp://{cfg.kv_host}:0")
        self._pub.bind(f"tcp://{cfg.kv_host}:0")
        self.events_address = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.arena = None
        self.arena_nonce = None  # decode over shm: what proves a prefill worker shares /dev/shm
        self.mooncake = None
        self.arena_addr = 0
        self.copier = None  # prefill: block copies to and from other prefill workers
        self.step_stats = StepStats()  # decode: step times for the router's Conductor
        self.link = None  # a group's stage: the hidden-state link to its neighbours
        engine_cfg = cfg.engine
        if cfg.group:
            from dataclasses import replace

            from engine.cluster.worker.stage_role import LinkIO

            self.link = LinkIO(cfg.stage)
            engine_cfg = replace(engine_cfg, stage=cfg.stage)
        # The engine's seams: its connector (the sender or receiver, wrapping the KV pool's
        # connector the engine builds), the block pool's listener (block events published) and,
        # on a group's stage, its hidden-state link.
        self.engine = LLMEngine(
            engine_cfg,
            connector_factory=self._make_connector,
            block_listener=lambda kind, key: self._block_events.append((kind, key)),
            stage_io=self.link,
        )
        self.namespace = _namespace_hex(self.engine)
        if self.link is not None:
            from engine.cluster.worker.stage_role import StageRole

            e = self.engine
            self.link.start(self.ctx, f"tcp://{cfg.kv_host}:0", e.model_config.hidden_size,
                            e.dtype, self._wake)  # fmt: skip
            self.role = StageRole(e, self.sender, self.link, self.worker_id, self._emit)
            self.kv_address, self.shm_path = "", ""
        elif cfg.role == "prefill":
            from engine.cluster.worker.block_copy import BlockCopier
            from engine.cluster.worker.roles import PrefillRole

            self.role = PrefillRole(self.engine, self.sender, self.worker_id, self._emit)
            self.copier = BlockCopier(
                self.engine, self.worker_id, self._emit, self.ctx, cfg.kv_host
            )
            self.kv_address, self.shm_path = "", ""
        else:
            from engine.cluster.worker.roles import DecodeRole

            if self.mooncake is not None:
                self.arena_addr = self.mooncake.register(self.arena.buf)
            self.role = DecodeRole(
                self.engine, self.receiver, self.worker_id, self._emit, cfg.kv_load_failure
            )
            self.kv_address, self.shm_path = self.receiver.address, self.arena.path

    def _make_connector(self, cache, inner):
        """The engine's connector factory: this role's KV sender or receiver over the engine's
        paged cache, wrapping ``inner`` (its KV pool's connector, or None). Called once the
        engine has built its model and cache, so a failed build leaves no arena behind."""
        cfg = self.cfg
        if cfg.transport == "mooncake":
            from engine.kv_connector.mooncake_transfer import MooncakeEndpoint

            self.mooncake = MooncakeEndpoint(cfg.kv_host, cfg.mooncake_metadata)
        if cfg.role == "prefill":
            from engine.kv_connector.sender import KVSender

            self.sender = KVSender(
                cache.kv,
                cache.block_size,
                inner=inner,
                mooncake=self.mooncake,
                layers=cache.layers,  # a stage's own layers of the model's
                model_layers=cache.model_layers,
            )
            return self.sender
        from engine.kv_connector.receiver import KVReceiver
        from engine.kv_connector.staging import StagingArena

        self.arena = StagingArena(cfg.staging_mb << 20, shared=cfg.transport == "shm")
        if self.arena.path:
            from engine.kv_connector.shm_proof import ArenaNonce

            self.arena_nonce = ArenaNonce(self.arena.path)
        self.receiver = KVReceiver(
            cache.kv,
            cache.block_size,
            self.arena,
            bind=f"tcp://{cfg.kv_host}:0",
            wake=self._wake,
            remote_writes=cfg.transport in ("shm", "mooncake"),
            local_writers=cfg.transport == "shm",  # Mooncake: a peer's NIC writes
            inner=inner,  # its KV pool: saves what it generates
        )
        return self.receiver

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

    def _register(self) -> m.Register:
        return m.Register(
            self.worker_id,
            self.cfg.role,
            os.getpid(),
            str(self.engine.model_path),
            self.engine.max_model_len,
            self.kv_address,
            self.shm_path,
            self.cfg.transport,
            socket.gethostname(),
            events_address=self.events_address,
            mooncake_address=self.mooncake.address if self.mooncake is not None else "",
            arena_addr=self.arena_addr,
            copy_address=self.copier.address if self.copier is not None else "",
            shm_digest=self.arena_nonce.digest if self.arena_nonce is not None else "",
            pid_ns=shm_proof.pid_namespace(),
            group=self.cfg.group,
            stage=self.cfg.stage.index,
            stages=self.cfg.stage.count,
            chunk_tokens=self._chunk_tokens() if self.cfg.group else 0,
            hidden_address=self.link.address if self.link is not None else "",
        )

    def _chunk_tokens(self) -> int:
        """A group's chunk: its stages' prefill budget per step (the long-prefill threshold
        when it is set, else max_num_batched_tokens)."""
        sc = self.engine.scheduler.config
        return sc.long_prefill_token_threshold or sc.max_num_batched_tokens

    def _heartbeat_loop(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)
        sock.setsockopt_string(zmq.IDENTITY, f"{self.worker_id}/hb")
        watch_peer(sock)  # back within seconds of a partition's end (liveness.py)
        curve.secure_client(sock)
        sock.connect(self.cfg.router)
        try:
            while not self._stop.wait(self.cfg.heartbeat_s):
                e = self.engine
                with e.metrics.lock:
                    finished = dict(e.metrics.finished)
                st = self.step_stats.take()
                hb = m.Heartbeat(
                    self.worker_id,
                    self.state,
                    len(e.scheduler.running),
                    len(e.scheduler.waiting) + len(e.scheduler.loading),
                    float(e.kv.usage()),
                    int(e.kv.pool.counts().used),
                    self._staging_used(),
                    self.role.num_requests,
                    finished=finished,
                    steps=st.steps,
                    step_s=st.step_s,
                    step_batch=st.batch,
                    step_tokens=st.tokens,
                    hidden_bytes_sent=self._hidden_bytes_sent(),
                )
                try:
                    sock.send_multipart(m.encode(hb), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the router is away; it will see us late or not at all
        finally:
            sock.close(linger=0)

    def _staging_used(self) -> int:
        """Bytes held for transfers in: KV staging (decode), a stage's hidden-state rows."""
        if self.arena is not None:
            return self.arena.used
        rx = self.link.receiver if self.link is not None else None
        return rx.used_bytes if rx is not None else 0

    def _hidden_bytes_sent(self) -> int:
        sender = self.link.sender if self.link is not None else None
        return sender.counters["bytes_sent"] if sender is not None else 0

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
        ctl.send_multipart(m.encode(self._register()))
        hb = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        hb.start()
        poller = zmq.Poller()
        poller.register(ctl, zmq.POLLIN)
        poller.register(self._wake_pull, zmq.POLLIN)
        if self.copier is not None:
            poller.register(self.copier.sock, zmq.POLLIN)
        log.info("%s worker %s up (router %s)", self.cfg.role, self.worker_id, self.cfg.router)
        next_check = 0.0
        next_register = time.monotonic() + REGISTER_EVERY_S
        stalled = False  # the last step ran nothing: a stage waiting for hidden states
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                if self.state == "draining" and not busy and not self.role.num_requests:
                    break
                if self._stop.is_set():
                    break
                # A stage whose requests wait for the stage before's hidden states sleeps until
                # they come (the receiver wakes this poll), not spinning a core its peers need.
                events = dict(poller.poll(0 if busy and not stalled else 50))
                if ctl in events:
                    self._take_control(ctl)
                if self.copier is not None and self.copier.sock in events:
                    self.copier.take()
                if self._wake_pull in events:
                    while True:
                        try:
                            self._wake_pull.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                if self.cfg.role == "decode":
                    self._take_transfers()
                    now = time.monotonic()
                    if now >= next_check:
                        next_check = now + 0.1
                        self.role.check_deadlines()
                if self.link is not None:
                    self._take_hidden()
                stalled = False
                if self.engine.has_unfinished_requests():
                    steps = self.engine.num_steps
                    self._step()
                    stalled = self.link is not None and self.engine.num_steps == steps
                if time.monotonic() >= next_register:  # a restarted router learns of us
                    next_register = time.monotonic() + REGISTER_EVERY_S
                    self._emit(self._register())
                self._flush(ctl)
            self._flush(ctl)
            ctl.send_multipart(m.encode(m.Goodbye(self.worker_id)))
            return 0
        finally:
            self._stop.set()
            hb.join(timeout=2)
            self.close()
            ctl.close(linger=1000)

    def _step(self) -> None:
        if self.cfg.role != "decode":
            self.role.after_step(self.engine.step())
            return
        running = self.engine.scheduler.running
        batch, tokens = len(running), sum(r.num_tokens for r in running)
        t0 = time.perf_counter()
        outputs = self.engine.step()
        self.step_stats.add(time.perf_counter() - t0, batch, tokens)
        self.role.after_step(outputs)

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
            elif isinstance(msg, m.FirstTokens):
                if self.cfg.role == "decode":
                    self.role.first_tokens(msg)
            elif isinstance(msg, m.SourceGone):
                if self.cfg.role == "decode":
                    self.role.source_gone(msg)
            elif isinstance(msg, m.ShmProbe):
                if self.cfg.role == "prefill":  # can this process read that arena's nonce?
                    nonce = shm_proof.read_nonce(msg.shm_path)
                    self._emit(m.ShmReach(self.worker_id, msg.decode_id, nonce.hex()))
            elif isinstance(msg, m.CopyBlocks):
                if self.copier is not None:
                    self.copier.send(msg)
            elif isinstance(msg, (m.PrefillRequest, m.DecodeRequest)):
                if self.state != "up":
                    self._emit(m.RequestError(msg.request_id, self.worker_id, 503, "draining"))
                elif isinstance(msg, m.PrefillRequest) == (self.cfg.role == "prefill"):
                    self.role.handle(msg)
                else:
                    self._emit(m.RequestError(msg.request_id, self.worker_id, 500, "wrong role"))
            else:
                log.warning("unexpected %s from the router", msg.TYPE)

    def _take_transfers(self) -> None:
        while True:
            try:
                rid = self.receiver.events.get_nowait()
            except queue.Empty:
                return
            self.role.on_transfer(rid)

    def _take_hidden(self) -> None:
        """A stage: hidden states that came (or failed), deadlines, failed sends onwards."""
        if self.link.receiver is not None:
            for rid in self.link.receiver.events():
                self.role.on_hidden(rid)
        self.role.check_link(time.monotonic())

    def _publish_block_events(self) -> None:
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

    def _flush(self, ctl: zmq.Socket) -> None:
        self._publish_block_events()
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
        conn = self.engine.connector
        if conn is not None:
            conn.close()
        if self.arena is not None:
            self.arena.close()
        if self.arena_nonce is not None:
            self.arena_nonce.close()
        if self.copier is not None:
            self.copier.close()
        if self.link is not None:
            self.link.close()
        self._wake_pull.close(linger=0)
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


def run_worker(cfg: WorkerConfig) -> int:
    worker = Worker(cfg)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.drain())
    return worker.run()
