"""The router: the cluster behind the ``EngineClient`` protocol, so the HTTP and RPC servers run
on it unchanged.

It is a facade over three parts of this package, which run on one IO thread (``io.py``): the
workers it knows (``membership.py``: registrations, heartbeats, deaths, the block events that say
which prefixes each holds), each request's phases (``phases.py``: placed by ``placement``, which
lists every call the router makes to it, then reserve, copy, prefill, decode, with retries and
deadlines) and the outputs assembled from what workers stream (``outputs.py``, with the core's
output builder). Callers (any asyncio loop, any thread) hand the IO thread commands and get
outputs through their own asyncio queue.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from engine.async_llm import EngineShuttingDownError
from engine.cluster import messages as m
from engine.cluster.placement import Placement
from engine.cluster.router import commands as cmd
from engine.cluster.router import shm_pairs
from engine.cluster.router.config import ClusterUnavailableError, RouterConfig
from engine.cluster.router.io import RouterIO
from engine.cluster.router.membership import Membership, Worker
from engine.cluster.router.phases import Phases
from engine.cluster.router.request import Choice, RouterRequest
from engine.core.metrics import EngineMetrics, MetricsSnapshot
from engine.core.scheduler import QueueFullError
from engine.core.validation import validate_priority, validate_prompt
from engine.errors import RequestError
from engine.kvstore.block_events import BlockEvent
from engine.model.loader import open_checkpoint
from engine.outputs import RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from engine.spec.stats import sum_spec_stats

if TYPE_CHECKING:
    from engine.structured.compiler import GrammarCompiler

__all__ = ["ClusterUnavailableError", "Router", "RouterConfig"]

PROBE_WAIT_S = 10.0  # wait_for_workers: for the shared-memory probes after the registrations


class Router:
    def __init__(self, cfg: RouterConfig | None = None, placement: Placement | None = None):
        self.cfg = cfg = cfg or RouterConfig()
        # The model's config and tokenizer, without its weights (the router computes nothing).
        self.model_path, checkpoint = open_checkpoint(cfg.model)
        self.tokenizer = checkpoint.tokenizer
        self.model_config = checkpoint.config
        if placement is None:
            from engine.cluster.conductor.adapter import make_placement

            placement = make_placement(cfg)
        self.stats = EngineMetrics()
        self._ids = itertools.count()
        self._accepting = True
        self._io = RouterIO(cfg.address)
        self.address = self._io.address
        model_max_len = checkpoint.config.max_position_embeddings
        self._members = Membership(cfg, model_max_len, placement, self._io)
        self._phases = Phases(cfg, self._members, placement, self.stats, self._io.send)
        self._members.on_death = self._phases.worker_died
        self._requests = self._phases.requests  # the requests in flight, by the caller's id
        self._grammar_compiler: GrammarCompiler | None = None  # made on the first constraint
        self._grammar_lock = threading.Lock()
        self._io.start(self)
        self._thread = self._io.thread

    @property
    def placement(self) -> Placement:
        return self._phases.placement

    @property
    def workers(self) -> dict[str, Worker]:
        return self._members.workers

    @property
    def max_model_len(self) -> int:
        return self._members.max_model_len

    # -- EngineClient -----------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        params = params or SamplingParams()
        if params.prompt_logprobs is not None:  # the workers do not send them back yet
            raise RequestError(
                "prompt_logprobs is not supported by the cluster router", "prompt_logprobs"
            )
        rid = request_id or f"cluster-{next(self._ids)}"
        if not self._accepting:
            raise EngineShuttingDownError("the router is shutting down")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        validate_prompt(ids, params, self.model_config.vocab_size, self.max_model_len)
        validate_priority(priority, self.cfg.scheduling_policy)
        if len(self._requests) >= self.cfg.max_pending:
            raise QueueFullError(f"too many requests in flight ({self.cfg.max_pending})")
        queue: asyncio.Queue = asyncio.Queue()
        now = time.monotonic()
        req = RouterRequest(
            rid,
            ids,
            text,
            params,
            asyncio.get_running_loop(),
            queue,
            now + self.cfg.request_timeout_s,
            [Choice(logprobs=[] if params.logprobs is not None else None) for _ in range(params.n)],
            RequestMetrics(arrival_time=now),
            priority,
        )
        self._io.command(cmd.Submit(req))
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._io.command(cmd.Abort(rid))

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile the params' structured-output constraint, if any, with the router's own
        compiler (the same tokenizer as the workers'), off the event loop: a constraint that is
        invalid, does not compile or not within the deadline is refused here (RequestError naming
        the field; GrammarBusyError when too many compiles are pending) before any worker sees
        it. The workers compile it again when they add the request (benign ones take ms)."""
        so = params.structured_outputs
        if so is None:
            return
        compiler = self._grammar_compiler
        if compiler is None:
            compiler = await asyncio.to_thread(self._make_grammar_compiler)
        await compiler.compile_async(so)

    def _make_grammar_compiler(self) -> GrammarCompiler:
        with self._grammar_lock:
            if self._grammar_compiler is None:
                from engine.structured.compiler import GrammarCompiler

                self._grammar_compiler = GrammarCompiler(
                    self.tokenizer, self.model_config.vocab_size
                )
            return self._grammar_compiler

    async def abort(self, request_id: str) -> None:
        self._io.command(cmd.Abort(request_id))

    def is_healthy(self) -> bool:
        return self._io.is_alive() and self._members.serving()

    async def health(self) -> None:
        if not self.is_healthy():
            raise ClusterUnavailableError(f"the cluster is not serving: {self.workers_status()}")

    def workers_status(self) -> dict[str, dict]:
        """Every worker that ever registered: its state (up, draining, dead, left) and what its
        last heartbeat said (/health and /metrics show these)."""
        return self._members.status()

    def recent_decisions(self) -> list[dict]:
        """The placement's last decisions, oldest first (the dashboard shows them)."""
        return list(self.placement.recent_decisions())

    def placement_of(self, request_id: str) -> tuple[str, str, str] | None:
        """(phase, prefill worker, decode worker) of a request in flight (tests, debugging)."""
        req = self._requests.get(request_id)
        return None if req is None else (req.phase, req.prefill, req.decode)

    def prefix_blocks(self, worker_id: str, block_hashes: list[bytes]) -> int:
        """How many leading blocks of a chain the worker holds, by its events (a hint)."""
        return self._members.prefix_blocks(worker_id, block_hashes)

    def metrics(self) -> MetricsSnapshot:
        ws = self._members.reporting()
        # Prompts are looked up in the prefix cache where they are prefilled: the prefill
        # workers and each group's first stage (its other stages look up the same prompts).
        lookups = [w.hb for w in ws if w.role == "prefill" and w.stage == 0]
        return self.stats.snapshot(
            num_running=sum(w.hb.running for w in ws),
            num_waiting=sum(w.hb.waiting for w in ws),
            kv_usage=max((w.hb.kv_usage for w in ws if w.role == "decode"), default=0.0),
            spec=sum_spec_stats([w.hb.spec for w in ws]),
            prefix_queries=sum(hb.prefix_queries for hb in lookups),
            prefix_hits=sum(hb.prefix_hits for hb in lookups),
        )

    async def shutdown(self, timeout: float = 30.0) -> None:
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._io.command(cmd.AbortAll())
        deadline = time.monotonic() + 5.0
        while self._requests and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Stop the IO thread (idempotent); requests in flight fail with 503."""
        self._io.stop()
        if self._grammar_compiler is not None:
            self._grammar_compiler.close()

    def wait_for_workers(
        self,
        prefill: int,
        decode: int,
        timeout: float,
        check: Callable[[], None] | None = None,
        groups: int = 0,
    ) -> None:
        """Block until that many workers of each role (and prefill groups, every stage
        registered) are up (launcher, tests), and then until
        the prefill workers answered their shared-memory probes (at most PROBE_WAIT_S more;
        unproven pairs use TCP). ``check`` is called on every poll and may raise to end the
        wait (the launcher's: a child exited)."""
        deadline = time.monotonic() + timeout
        while True:
            if check is not None:
                check()
            m_ = self._members
            if (
                m_.count_up("prefill") >= prefill
                and m_.count_up("decode") >= decode
                and m_.count_groups_up() >= groups
            ):
                probe_deadline = min(deadline, time.monotonic() + PROBE_WAIT_S)
                while m_.probes_pending() and time.monotonic() < probe_deadline:
                    time.sleep(0.02)
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
        self._io.command(cmd.AddPool(source, events_address))

    def set_placement(self, placement: Placement) -> None:
        """Place requests from now on with ``placement`` (benchmarks compare policies on one
        cluster); it learns the live workers on its first ``place``. Pools added before are not
        carried over."""
        self._io.command(cmd.SetPlacement(placement))

    # -- on the IO thread (io.Handler) ------------------------------------------------------

    def on_command(self, command: cmd.RouterCommand) -> None:
        match command:
            case cmd.Submit(request):
                self._phases.submit(request)
            case cmd.Abort(request_id):
                self._phases.abort(request_id)
            case cmd.AbortAll():
                self._phases.abort_all()
            case cmd.AddPool(source, events_address):
                self._members.add_pool(source, events_address, time.monotonic())
            case cmd.SetPlacement(placement):
                self._members.placement = self._phases.placement = placement

    def on_message(self, identity: bytes, msg: m.Message, now: float) -> None:
        if isinstance(msg, m.Register):
            new = self._members.register(identity, msg, now)
            w = self._members.workers.get(msg.worker_id)
            if w is not None and w.live and w.identity == identity and w.abandoned:
                # Back from a partition (declared dead, or its Aborts could not be sent): it
                # drops what was given up on it; what cannot be sent now waits for the next.
                w.abandoned = [r for r in w.abandoned if not self._io.send(w, m.Abort(r))]
            if new is not None:
                for prefill, probe in shm_pairs.probes(new, self._members.workers.values()):
                    self._io.send(prefill, probe)
        elif isinstance(msg, m.Heartbeat):
            self._members.heartbeat(msg, now)
        elif isinstance(msg, m.Goodbye):
            self._members.goodbye(identity, msg)
        elif (sender := self._members.sender(identity, now)) is not None:
            if isinstance(msg, m.ShmReach):
                decode = self._members.reachable(msg.decode_id)
                shm_pairs.take_reach(sender, decode, msg)
            else:
                self._phases.on_message(sender, msg, now)

    def on_block_event(self, event: BlockEvent) -> None:
        self._members.take_event(event)

    def on_tick(self, now: float) -> None:
        self._members.check_silence(now)
        self._phases.check_deadlines(now)

    def on_stop(self) -> None:
        self._phases.fail_all(ClusterUnavailableError("the router stopped"))
