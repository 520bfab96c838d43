"""The router: the cluster behind the ``EngineClient`` protocol, so the HTTP and RPC servers run
on it unchanged.

It keeps the workers' registrations and heartbeats (a worker silent for ``heartbeat_timeout_s``
is dead: nothing more is placed there), places each request on a prefill and a decode worker
(``placement.Placement``, which lists every call the router makes to its placement), and drives
it: ``DecodeRequest`` (the decode worker reserves staging) -> ``PrefillRequest`` (the prefill
worker streams KV there and reports the first token, which the client sees at once) -> the decode
worker's tokens. Aborts go to both sides.

Faults: a request whose worker dies, or that a worker refuses (overloaded, draining), is placed
again while the client has seen nothing of it (up to ``max_retries``); after its first token it
ends with a clear error (503). Every phase has a deadline, so no request waits forever.

One IO thread owns the ROUTER socket and all state; callers (any asyncio loop, any thread) hand it
commands through a deque and a wake pipe, and get outputs through their own asyncio queue.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import zmq

from engine.async_llm import EngineDeadError, EngineShuttingDownError
from engine.cluster import messages as m
from engine.cluster.placement import Placement, RoundRobin, WorkerView
from engine.core.llm_engine import LLMEngine
from engine.core.metrics import EngineMetrics, MetricsSnapshot
from engine.core.scheduler import QueueFullError
from engine.ipc import curve
from engine.ipc.wire import params_to_wire
from engine.model.loader import open_checkpoint
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class ClusterUnavailableError(EngineDeadError):
    """No live worker can take the request, or its worker died (HTTP 503)."""


@dataclass(frozen=True)
class RouterConfig:
    address: str = "tcp://127.0.0.1:0"
    model: str = "default"
    max_model_len: int | None = None  # None: the smallest the workers register with
    heartbeat_timeout_s: float = 5.0
    phase_timeout_s: float = 60.0  # decode reservation; first token after placement
    transfer_deadline_s: float = 120.0  # the decode worker's wait for KV (then its policy)
    request_timeout_s: float = 3600.0
    max_retries: int = 2
    max_pending: int = 4096
    kv_transport: str | None = None  # None: shm when both workers share a host, else tcp
    stream_layers: bool = True
    # The Conductor's placement (conductor_placement.make_placement validates these).
    policy: str = "kvcentric"
    rejection: str = "predicted"
    ttft_slo_s: float = 30.0
    # Not the paper's 0.1 s (its 70B model on GPUs): SmolLM2 on one CPU thread takes 50 to
    # 150 ms a decode step alone, and the Conductor learns the real step times (heartbeats), so
    # a 0.1 s default would refuse most requests on a CPU cluster.
    tbt_slo_s: float = 1.0
    block_size: int = 16  # the workers' KV block size: prompts are hashed as they hash them
    # How long a prefill waits for the block copy the Conductor planned before it (then it runs
    # and recomputes what did not arrive).
    copy_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        for name in (
            "copy_timeout_s",
            "heartbeat_timeout_s",
            "phase_timeout_s",
            "transfer_deadline_s",
            "request_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.kv_transport not in (None, "shm", "tcp", "mooncake"):
            raise ValueError(
                f"kv_transport must be shm, tcp or mooncake, got {self.kv_transport!r}"
            )


@dataclass
class _Worker:
    worker_id: str
    role: str
    identity: bytes
    pid: int
    host: str
    kv_address: str
    shm_path: str
    transport: str
    max_model_len: int
    events_address: str = ""
    mooncake_address: str = ""
    arena_addr: int = 0
    copy_address: str = ""  # prefill: where other prefill workers push block copies
    state: str = "up"  # up | draining | dead | left
    last_seen: float = 0.0
    hb: m.Heartbeat | None = None


@dataclass
class _Choice:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_text: int = 0


@dataclass
class _Request:
    request_id: str
    ids: list[int]
    prompt: str | None
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    deadline: float
    choices: list[_Choice]
    metrics: RequestMetrics
    phase: str = "new"  # new | reserving | copying | prefill | decode
    prefill: str = ""
    decode: str = ""
    attempts: int = 0
    phase_deadline: float = 0.0
    wire_id: str = ""  # the id workers know this attempt by: request id / attempt
    copy_wait: bool = False  # a block copy to its prefill worker is under way
    ready: tuple | None = None  # (decode worker, DecodeReady) while the copy finishes

    @property
    def streamed(self) -> bool:
        return any(c.tokens for c in self.choices)


_DONE = object()


class Router:
    def __init__(self, cfg: RouterConfig | None = None, placement: Placement | None = None):
        self.cfg = cfg = cfg or RouterConfig()
        # The model's config and tokenizer, without its weights (the router computes nothing).
        self.model_path, checkpoint = open_checkpoint(cfg.model)
        self.tokenizer = checkpoint.tokenizer
        self.model_config = checkpoint.config
        self.max_model_len = cfg.max_model_len or checkpoint.config.max_position_embeddings
        self._model_max_len = self.max_model_len
        if placement is None:
            from engine.cluster.conductor.adapter import make_placement

            placement = make_placement(cfg)
        self.placement = placement or RoundRobin()
        self.stats = EngineMetrics()
        self.workers: dict[str, _Worker] = {}
        self._requests: dict[str, _Request] = {}  # by the caller's request id
        self._wire: dict[str, _Request] = {}  # by the current attempt's id
        self._commands: deque = deque()
        self._ids = itertools.count()
        self._accepting = True
        self._stop = False
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.setsockopt(zmq.MAXMSGSIZE, m.MAX_HEADER_BYTES + 1024)
        curve.secure_server(self._sock, cfg.address)
        self._sock.bind(cfg.address)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        # Block events from every worker: which prefix blocks each holds (a hint for placement).
        self.block_index: dict[str, set[bytes]] = {}
        self._events = self._ctx.socket(zmq.SUB)
        self._events.setsockopt(zmq.LINGER, 0)
        self._events.setsockopt(zmq.MAXMSGSIZE, 1 << 20)
        self._events.setsockopt(zmq.SUBSCRIBE, b"")
        curve.secure_client(self._events)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._lock = threading.Lock()  # guards _commands and workers' view for readers
        self._thread = threading.Thread(target=self._loop, name="router-io", daemon=True)
        self._thread.start()

    # -- EngineClient -----------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        params = params or SamplingParams()
        if params.prompt_logprobs is not None:  # the workers do not send them back yet
            raise ValueError("prompt_logprobs is not supported by the cluster router")
        rid = request_id or f"cluster-{next(self._ids)}"
        if not self._accepting:
            raise EngineShuttingDownError("the router is shutting down")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        LLMEngine.validate(
            SimpleNamespace(model_config=self.model_config, max_model_len=self.max_model_len),
            ids,
            params,
        )
        if len(self._requests) >= self.cfg.max_pending:
            raise QueueFullError(f"too many requests in flight ({self.cfg.max_pending})")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        now = time.monotonic()
        req = _Request(
            rid,
            ids,
            text,
            params,
            loop,
            queue,
            now + self.cfg.request_timeout_s,
            [
                _Choice(logprobs=[] if params.logprobs is not None else None)
                for _ in range(params.n)
            ],
            RequestMetrics(arrival_time=now),
        )
        self._command(("submit", req))
        finished = False
        try:
            while True:
                item = await queue.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._command(("abort", rid))

    async def abort(self, request_id: str) -> None:
        self._command(("abort", request_id))

    def is_healthy(self) -> bool:
        if not self._thread.is_alive():
            return False
        roles = {w.role for w in list(self.workers.values()) if w.state == "up"}
        return roles == {"prefill", "decode"}

    async def health(self) -> None:
        if not self.is_healthy():
            raise ClusterUnavailableError(f"the cluster is not serving: {self.workers_status()}")

    def workers_status(self) -> dict[str, dict]:
        """Every worker that ever registered: its state (up, draining, dead, left) and what its
        last heartbeat said (/health and /metrics show these)."""
        out = {}
        now = time.monotonic()
        for w in list(self.workers.values()):
            hb = w.hb
            out[w.worker_id] = {
                "role": w.role,
                "state": w.state,
                "pid": w.pid,
                "host": w.host,
                "running": hb.running if hb else 0,
                "waiting": hb.waiting if hb else 0,
                "kv_usage": hb.kv_usage if hb else 0.0,
                "used_blocks": hb.used_blocks if hb else 0,
                "staging_used": hb.staging_used if hb else 0,
                "transfers": hb.transfers if hb else 0,
                "finished": dict(hb.finished) if hb else {},
                "heartbeat_age_s": round(max(0.0, now - w.last_seen), 3),
            }
        return out

    def placement_of(self, request_id: str) -> tuple[str, str, str] | None:
        """(phase, prefill worker, decode worker) of a request in flight (tests, debugging)."""
        req = self._requests.get(request_id)
        return None if req is None else (req.phase, req.prefill, req.decode)

    def metrics(self) -> MetricsSnapshot:
        ws = [w for w in list(self.workers.values()) if w.state in ("up", "draining") and w.hb]
        s = self.stats
        with s.lock:
            return MetricsSnapshot(
                num_running=sum(w.hb.running for w in ws),
                num_waiting=sum(w.hb.waiting for w in ws),
                kv_usage=max((w.hb.kv_usage for w in ws if w.role == "decode"), default=0.0),
                num_blocks=0,
                prefix_queries=0,
                prefix_hits=0,
                preemptions=0,
                prompt_tokens=s.prompt_tokens,
                generation_tokens=s.generation_tokens,
                computed_prompt_tokens=s.computed_prompt_tokens,
                finished=dict(s.finished),
                rejected=s.rejected,
                ttft=s.ttft.cumulative(),
                ttft_sum=s.ttft.total,
                itl=s.itl.cumulative(),
                itl_sum=s.itl.total,
                e2e=s.e2e.cumulative(),
                e2e_sum=s.e2e.total,
                queue_time=s.queue_time.cumulative(),
                queue_time_sum=s.queue_time.total,
            )

    async def shutdown(self, timeout: float = 30.0) -> None:
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._command(("abort_all",))
        deadline = time.monotonic() + 5.0
        while self._requests and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Stop the IO thread (idempotent); requests in flight fail with 503."""
        if not self._thread.is_alive():
            return
        self._stop = True
        self._wake()
        self._thread.join(timeout=10)

    def wait_for_workers(
        self, prefill: int, decode: int, timeout: float, check: Callable[[], None] | None = None
    ) -> None:
        """Block until that many workers of each role are up (launcher, tests). ``check`` is
        called on every poll and may raise to end the wait (the launcher's: a child exited)."""
        deadline = time.monotonic() + timeout
        while True:
            if check is not None:
                check()
            up = [w for w in list(self.workers.values()) if w.state == "up"]
            if (
                sum(w.role == "prefill" for w in up) >= prefill
                and sum(w.role == "decode" for w in up) >= decode
            ):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"workers did not register within {timeout:.0f} s: {self.workers_status()}"
                )
            time.sleep(0.05)

    # -- callers -> IO thread ---------------------------------------------------------------

    def add_pool(self, source: str, events_address: str) -> None:
        """A pool service whose block events (``source`` names it in them) the placement hears:
        a holder prefill workers load prefixes from (conductor_placement.py)."""
        self._command(("add_pool", source, events_address))

    def set_placement(self, placement: Placement) -> None:
        """Place requests from now on with ``placement`` (benchmarks compare policies on one
        cluster); it learns the live workers on its first ``place``. Pools added before are not
        carried over."""
        self._command(("set_placement", placement))

    def _command(self, cmd: tuple) -> None:
        self._commands.append(cmd)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full of wakes already, or the router stopped

    def _deliver(self, req: _Request, item) -> None:
        try:
            req.loop.call_soon_threadsafe(req.queue.put_nowait, item)
        except RuntimeError:
            pass  # the caller's loop is closed

    # -- the IO thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self._events, zmq.POLLIN)
        next_check = 0.0
        try:
            while not self._stop:
                events = dict(poller.poll(100))
                if self._wake_r in events:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                if self._sock in events:
                    for _ in range(10_000):
                        try:
                            frames = self._sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        try:
                            self._on_frames(frames)
                        except Exception:  # one bad message costs that message, not the router
                            log.exception("a message from %r failed", frames[0][:64])
                if self._events in events:
                    self._take_block_events()
                while self._commands:
                    self._on_command(self._commands.popleft())
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + 0.1
                    self._check_timeouts(now)
        except Exception:
            log.exception("router IO thread died")
            raise
        finally:
            for req in list(self._requests.values()):
                self._fail(req, ClusterUnavailableError("the router stopped"))
            self._sock.close(linger=0)
            self._events.close(linger=0)
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _send(self, worker: _Worker, msg: m.Message) -> bool:
        try:
            self._sock.send_multipart([worker.identity, *m.encode(msg)], zmq.NOBLOCK)
            return True
        except (zmq.Again, zmq.ZMQError) as exc:
            log.warning("cannot send %s to %s: %s", msg.TYPE, worker.worker_id, exc)
            return False

    def _on_command(self, cmd: tuple) -> None:
        if cmd[0] == "submit":
            req: _Request = cmd[1]
            if req.request_id in self._requests:
                self._deliver(req, ValueError(f"request_id {req.request_id!r} is in use"))
                return
            self._requests[req.request_id] = req
            with self.stats.lock:
                self.stats.prompt_tokens += len(req.ids) * req.params.n
            self._place(req)
        elif cmd[0] == "abort":
            req = self._requests.get(cmd[1])
            if req is not None:
                self._abort_legs(req)
                self._finish(req, "abort")
        elif cmd[0] == "add_pool":
            self.block_index[cmd[1]] = set()
            self._events.connect(cmd[2])
            self.placement.worker_joined(cmd[1], "pool", time.monotonic())
        elif cmd[0] == "set_placement":
            self.placement = cmd[1]
        elif cmd[0] == "abort_all":
            for req in list(self._requests.values()):
                self._abort_legs(req)
                self._finish(req, "abort")

    def _live(self, role: str) -> list[WorkerView]:
        out = []
        for w in self.workers.values():
            if w.role == role and w.state == "up":
                hb = w.hb
                out.append(
                    WorkerView(
                        w.worker_id,
                        role,
                        w.host,
                        hb.running if hb else 0,
                        hb.waiting if hb else 0,
                        hb.kv_usage if hb else 0.0,
                    )
                )
        return out

    def _place(self, req: _Request) -> None:
        placed = self.placement.place(req.ids, self._live("prefill"), self._live("decode"))
        if placed is None:
            exc = self.placement.rejection_error()  # an SLO's: 429
            self._fail(req, exc or ClusterUnavailableError("no live prefill and decode workers"))
            return
        req.prefill, req.decode = placed
        req.phase = "reserving"
        req.phase_deadline = time.monotonic() + self.cfg.phase_timeout_s
        # A fresh id per attempt: late messages of an abandoned attempt can never be taken for
        # this one's (by the router, or by a decode worker's staging area).
        self._wire.pop(req.wire_id, None)
        req.wire_id = f"{req.request_id}/{req.attempts}"
        self._wire[req.wire_id] = req
        self.placement.bind(req.wire_id)
        req.ready = None
        req.copy_wait = self._start_copies(req)
        p = self.workers[req.prefill]
        msg = m.DecodeRequest(
            req.wire_id,
            req.ids,
            params_to_wire(req.params),
            self.cfg.transfer_deadline_s,
            sender_pid=p.pid,
            sender_host=p.host,
        )
        if not self._send(self.workers[req.decode], msg):
            self._retry(req, f"decode worker {req.decode} is unreachable")

    def _start_copies(self, req: _Request) -> bool:
        """Ask the source of each block copy the placement planned between prefill workers to
        send it (block_copy.py); True if one was sent. Copies from a pool need nothing: the
        prefill worker's pool lookup performs them."""
        sent = False
        for src_id, dst_id, start, end in self.placement.planned_copies():
            src, dst = self.workers.get(src_id), self.workers.get(dst_id)
            if src is None or dst is None or dst_id != req.prefill or not dst.copy_address:
                continue
            if src.role != "prefill" or src.state != "up" or end <= start:
                continue
            bs = self.cfg.block_size
            msg = m.CopyBlocks(req.wire_id, req.ids[: end * bs], start, dst.copy_address)
            sent = self._send(src, msg) or sent
        return sent

    def _retry(self, req: _Request, why: str, code: int = 503) -> None:
        self._abort_legs(req)
        if req.streamed or req.attempts >= self.cfg.max_retries:
            self._fail(req, ClusterUnavailableError(f"request {req.request_id}: {why}"))
            return
        self.placement.finished(req.wire_id, time.monotonic())  # this attempt is abandoned
        req.attempts += 1
        log.warning("request %s: %s; placing it again", req.request_id, why)
        self._place(req)

    def _abort_legs(self, req: _Request) -> None:
        for wid in (req.prefill, req.decode):
            w = self.workers.get(wid)
            if w is not None and w.state in ("up", "draining"):
                self._send(w, m.Abort(req.wire_id))
        req.prefill = req.decode = ""

    def _fail(self, req: _Request, exc: BaseException) -> None:
        self.placement.finished(req.wire_id, time.monotonic())
        self._requests.pop(req.request_id, None)
        self._wire.pop(req.wire_id, None)
        with self.stats.lock:
            self.stats.finished["error"] = self.stats.finished.get("error", 0) + 1
        self._deliver(req, exc)

    def _finish(self, req: _Request, reason: str) -> None:
        """End req now (an abort): unfinished choices get ``reason``."""
        for c in req.choices:
            if c.finish_reason is None:
                c.finish_reason = reason
        self._emit_output(req)

    def _on_frames(self, frames: list) -> None:
        if len(frames) < 2:
            return
        identity = frames[0]
        try:
            msg = m.decode(frames[1:])
        except m.MessageError as exc:
            log.warning("bad message from %r: %s", identity[:64], exc)
            return
        now = time.monotonic()
        if isinstance(msg, m.Register):
            self._on_register(identity, msg, now)
            return
        wid = getattr(msg, "worker_id", None)
        if isinstance(msg, m.Heartbeat):
            w = self.workers.get(msg.worker_id)
            if w is not None and w.state in ("up", "draining"):
                w.last_seen, w.hb = now, msg
                if msg.state == "draining":
                    w.state = "draining"
                if msg.steps > 0 and w.role == "decode":  # the Conductor's TBT model learns
                    self.placement.decode_progress(
                        w.worker_id, now, msg.step_batch, msg.step_tokens, msg.step_s
                    )
            return
        if isinstance(msg, m.Goodbye):
            w = self.workers.get(msg.worker_id)
            if w is not None and w.identity == identity:
                self._on_death(w, "left")
            return
        sender = next((w for w in self.workers.values() if w.identity == identity), None)
        if sender is None:
            return
        sender.last_seen = now
        req = self._wire.get(getattr(msg, "request_id", ""))
        if req is None:
            return  # finished, aborted or an abandoned attempt: late messages are dropped
        wid = sender.worker_id
        if isinstance(msg, m.DecodeReady):
            if wid != req.decode or req.phase != "reserving":
                return
            if msg.error is not None:
                self._retry(req, f"decode worker {wid}: {msg.error}")
                return
            if req.copy_wait:  # the prefill starts when the copy is in (or late)
                req.ready, req.phase = (sender, msg), "copying"
                req.phase_deadline = time.monotonic() + self.cfg.copy_timeout_s
                return
            self._start_prefill(req, sender, msg)
        elif isinstance(msg, m.CopyDone):
            if wid != req.prefill or not req.copy_wait:
                return
            req.copy_wait = False
            self.placement.copy_done(req.wire_id, msg.blocks)
            if req.phase == "copying":
                self._start_prefill(req, *req.ready)
        elif isinstance(msg, m.Outputs):
            if wid not in (req.prefill, req.decode):
                return
            if wid == req.prefill and req.phase == "prefill":
                req.phase = "decode"
                req.metrics.num_cached_tokens = msg.num_cached_tokens
                self.placement.prefill_done(req.wire_id, now, msg.num_cached_tokens)
            if wid == req.prefill:
                # The decode worker learns the first tokens the client gets, in case the KV
                # transfer fails before its KVDone: it then recomputes from these.
                d = self.workers.get(req.decode)
                if d is not None and d.state in ("up", "draining"):
                    self._send(d, m.FirstTokens(req.wire_id, msg.outputs))
            self._apply(req, msg.outputs)
        elif isinstance(msg, m.TransferFailed):
            if wid != req.decode:
                return
            p = self.workers.get(req.prefill)
            if p is not None:
                self._send(p, m.Abort(req.wire_id))
            if msg.recompute:
                req.phase = "decode"  # the decode worker prefills it itself
                req.phase_deadline = time.monotonic() + self.cfg.request_timeout_s
            else:
                self._abort_legs(req)
                self._fail(req, RuntimeError(f"KV transfer failed: {msg.reason}"))
        elif isinstance(msg, m.RequestError):
            if wid not in (req.prefill, req.decode):
                return
            if msg.code in (429, 503):
                self._retry(req, f"worker {wid}: {msg.message}")
                return
            self._abort_legs(req)
            exc = ValueError(msg.message) if msg.code == 400 else RuntimeError(msg.message)
            self._fail(req, exc)

    def _on_register(self, identity: bytes, msg: m.Register, now: float) -> None:
        if msg.role not in ("prefill", "decode") or msg.max_model_len < 1:
            log.warning("refused to register %r: role %r, max_model_len %d", msg.worker_id[:64],
                        msg.role[:16], msg.max_model_len)  # fmt: skip
            return
        old = self.workers.get(msg.worker_id)
        if old is not None and old.pid == msg.pid and old.state in ("up", "draining"):
            old.identity, old.last_seen = identity, now  # a repeated registration
            return
        if old is not None and old.state in ("up", "draining") and old.pid != msg.pid:
            self._on_death(old, "dead")  # restarted before its silence was noticed
        self.workers[msg.worker_id] = _Worker(
            msg.worker_id,
            msg.role,
            identity,
            msg.pid,
            msg.host,
            msg.kv_address,
            msg.shm_path,
            msg.transport,
            msg.max_model_len,
            events_address=msg.events_address,
            mooncake_address=msg.mooncake_address,
            arena_addr=msg.arena_addr,
            copy_address=msg.copy_address,
            last_seen=now,
        )
        self.block_index[msg.worker_id] = set()
        self.placement.worker_joined(msg.worker_id, msg.role, now)
        if msg.events_address:
            try:
                self._events.connect(msg.events_address)
            except zmq.ZMQError as exc:  # its block events are a hint: serve without them
                log.warning("worker %s: bad events address: %s", msg.worker_id, exc)
        self._refresh_max_model_len()
        log.info("worker %s (%s, pid %d) joined", msg.worker_id, msg.role, msg.pid)

    def _start_prefill(self, req: _Request, decode: _Worker, ready: m.DecodeReady) -> None:
        p = self.workers.get(req.prefill)
        if p is None or p.state != "up":
            self._retry(req, f"prefill worker {req.prefill} is gone")
            return
        transport = self.cfg.kv_transport
        same_host = p.host == decode.host and decode.shm_path
        if decode.mooncake_address and (transport or decode.transport) == "mooncake":
            transport = "mooncake"  # both ends must have joined with their Transfer Engines
        elif transport is None:
            transport = "shm" if same_host and decode.transport == "shm" else "tcp"
        elif transport != "tcp" and not same_host:
            transport = "tcp"
        req.phase = "prefill"
        req.phase_deadline = time.monotonic() + self.cfg.phase_timeout_s
        self.placement.prefill_started(req.wire_id, time.monotonic())
        msg = m.PrefillRequest(
            req.wire_id,
            req.ids,
            params_to_wire(req.params),
            decode.worker_id,
            decode.kv_address,
            transport,
            decode.shm_path if transport == "shm" else "",
            ready.offset,
            ready.nbytes,
            stream_layers=self.cfg.stream_layers,
            peer_address=decode.mooncake_address if transport == "mooncake" else "",
            peer_base=decode.arena_addr if transport == "mooncake" else 0,
        )
        if not self._send(p, msg):
            self._retry(req, f"prefill worker {p.worker_id} is unreachable")

    def _apply(self, req: _Request, outputs: list[dict]) -> None:
        from engine.ipc.wire import logprob_from_wire as lp_from_wire

        for o in outputs:
            i = o.get("index")
            if not isinstance(i, int) or not 0 <= i < len(req.choices):
                continue
            c = req.choices[i]
            skip = len(c.tokens) - o["offset"]
            if skip < 0:
                log.error("request %s: a gap in choice %d's tokens", req.request_id, i)
                continue
            new = o["token_ids"][skip:]
            c.tokens += new
            if c.logprobs is not None and o.get("logprobs"):
                lps = [lp_from_wire(x) for x in o["logprobs"][skip:]]
                c.logprobs += lps
                c.cumulative_logprob += sum(lp.logprob for lp in lps)
            tskip = len(c.text) - o["text_offset"]
            if tskip >= 0:
                c.text += o["text"][tskip:]
            if o["finish_reason"] and c.finish_reason is None:
                c.finish_reason, c.stop_reason = o["finish_reason"], o["stop_reason"]
        self._emit_output(req)

    def _emit_output(self, req: _Request) -> None:
        now = time.monotonic()
        outs, moved = [], 0
        for i, c in enumerate(req.choices):
            new_ids = c.tokens[c.sent_tokens :]
            moved += len(new_ids)
            outs.append(
                CompletionOutput(
                    index=i,
                    text=c.text,
                    token_ids=list(c.tokens),
                    logprobs=c.logprobs,
                    cumulative_logprob=c.cumulative_logprob,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    new_text=c.text[c.sent_text :],
                    new_token_ids=new_ids,
                    new_logprobs=None if c.logprobs is None else c.logprobs[c.sent_tokens :],
                )
            )
            c.sent_tokens, c.sent_text = len(c.tokens), len(c.text)
        finished = all(c.finish_reason is not None for c in req.choices)
        m_ = req.metrics
        with self.stats.lock:
            if moved:
                if m_.first_token_time is None:
                    m_.first_token_time = now
                    self.stats.ttft.observe(now - m_.arrival_time)
                elif m_.last_token_time is not None:
                    self.stats.itl.observe(now - m_.last_token_time)
                m_.last_token_time = now
                self.stats.generation_tokens += moved
            if finished:
                m_.finished_time = now
                self.stats.e2e.observe(now - m_.arrival_time)
                for c in req.choices:
                    r = c.finish_reason
                    self.stats.finished[r] = self.stats.finished.get(r, 0) + 1
        if finished:
            self.placement.finished(req.wire_id, now, sum(len(c.tokens) for c in req.choices))
            self._requests.pop(req.request_id, None)
            self._wire.pop(req.wire_id, None)
        self._deliver(req, RequestOutput(req.request_id, req.prompt, req.ids, outs, finished, m_))

    def _take_block_events(self) -> None:
        import msgpack

        for _ in range(10_000):
            try:
                raw = self._events.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                ev = msgpack.unpackb(raw, raw=False)
                kind, keys, source = ev["type"], ev["keys"], ev["source"]
            except Exception:  # not an event: a hint source must never stop the router
                continue
            index = self.block_index.get(source) if isinstance(source, str) else None
            if index is None or not isinstance(keys, list):
                continue
            if kind == "stored":
                index.update(k for k in keys if isinstance(k, bytes))
            elif kind == "removed":
                index.difference_update(k for k in keys if isinstance(k, bytes))
            if isinstance(ev, dict):
                self.placement.on_event(source, ev)

    def prefix_blocks(self, worker_id: str, block_hashes: list[bytes]) -> int:
        """How many leading blocks of a chain the worker holds, by its events (a hint)."""
        index = self.block_index.get(worker_id, set())
        n = 0
        for h in block_hashes:
            if h not in index:
                break
            n += 1
        return n

    def _refresh_max_model_len(self) -> None:
        """The smallest of the live workers': one that left no longer limits the cluster."""
        if self.cfg.max_model_len is None:
            lens = [w.max_model_len for w in self.workers.values() if w.state == "up"]
            self.max_model_len = min([*lens, self._model_max_len])

    def _on_death(self, w: _Worker, state: str) -> None:
        w.state = state
        self._refresh_max_model_len()
        self.placement.worker_left(w.worker_id, time.monotonic())
        self.block_index.pop(w.worker_id, None)
        if w.events_address:
            try:
                self._events.disconnect(w.events_address)
            except zmq.ZMQError:
                pass
        log.warning("worker %s is %s", w.worker_id, state)
        for req in list(self._requests.values()):
            if w.worker_id in (req.prefill, req.decode):
                if w.worker_id == req.prefill and req.phase == "decode":
                    req.prefill = ""  # its part is done; the decode worker carries on
                    d = self.workers.get(req.decode)
                    if d is not None and d.state in ("up", "draining"):
                        # Its KV may not all have left: the decode worker need not wait out
                        # the transfer deadline (it recomputes from the first tokens).
                        self._send(d, m.SourceGone(req.wire_id, w.worker_id))
                    continue
                if w.worker_id == req.prefill:
                    req.prefill = ""
                else:
                    req.decode = ""
                self._retry(req, f"worker {w.worker_id} died")

    def _check_timeouts(self, now: float) -> None:
        for w in list(self.workers.values()):
            if w.state in ("up", "draining") and now - w.last_seen > self.cfg.heartbeat_timeout_s:
                self._on_death(w, "dead")
        for req in list(self._requests.values()):
            if now > req.deadline:
                self._abort_legs(req)
                self._fail(req, TimeoutError(f"request {req.request_id} passed its deadline"))
            elif req.phase == "copying" and now > req.phase_deadline:
                req.copy_wait = False  # the copy is late: prefill without it
                self._start_prefill(req, *req.ready)
            elif req.phase in ("reserving", "prefill") and now > req.phase_deadline:
                self._retry(req, f"no progress in the {req.phase} phase", code=503)
