"""An asyncio front for one engine: many concurrent callers, one engine loop thread.

The engine is owned by a single background thread. Callers submit commands (``AddRequest``,
``AbortRequest``: typed, so the request path reads in types) through a bounded queue; the loop
applies them between steps and pushes each step's outputs to the callers' asyncio queues with
``call_soon_threadsafe``. Closing a ``generate`` iterator early (a
client that disconnects) aborts the request and frees its KV blocks.

This is the narrow interface the servers use (submit/stream, abort, health, metrics); a cluster
client can offer the same methods.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.metrics import MetricsSnapshot
from engine.core.scheduler import QueueFullError
from engine.errors import RequestError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine loop died; requests in flight fail with this."""


class EngineShuttingDownError(RuntimeError):
    """The engine no longer admits requests (HTTP 503)."""


class IncompleteRequestError(EngineDeadError):
    """A request ended without its whole answer, and not because its caller asked: its outputs
    stopped before a final one, or a choice ended with a finish reason that is no answer (one
    of an engine's own, or "abort" where nobody aborted it). The servers answer 503 naming
    why; a partial answer is never passed off as whole."""


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Queue a request that the caller's thread validated (unless aborted meanwhile)."""

    request_id: str
    prompt_token_ids: list[int]
    prompt_text: str | None  # the text the ids were encoded from; None: ids were given
    params: SamplingParams
    cache_salt: str | None
    priority: int = 0


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Abort a request (its caller stopped listening, or asked)."""

    request_id: str


Command = AddRequest | AbortRequest  # what crosses from the callers to the engine thread

_DONE = object()
SHUTDOWN_GRACE_S = 30.0  # after the deadline: the step already running ends, aborts land
_MLP_TOKENS = 256  # a token's non-attention work, in units of attended-to tokens
_SAFETY = 0.7  # a drain step is planned to use at most this share of the time left


class _StepMeter:
    """The cost of a step on this machine, learnt as the engine runs (engine thread only).

    A step's work is counted as sum(tokens_i * (context_i + _MLP_TOKENS)) over the requests
    it ran: attention grows with the context a chunk attends to, so a prefill chunk deep into
    a long prompt costs far more than the first one. ``seconds_per_unit`` is an average.
    """

    def __init__(self) -> None:
        self.seconds_per_unit = 0.0

    @staticmethod
    def snapshot(sched) -> list:
        reqs = list(sched.running) + list(itertools.islice(sched.waiting, 64))
        return [(r, r.num_computed_tokens) for r in reqs]

    def observe(self, before: list, seconds: float) -> None:
        work = 0
        for req, computed in before:
            done = req.num_computed_tokens - computed
            if done > 0:
                work += done * (req.num_computed_tokens + _MLP_TOKENS)
        if work > 0:
            rate = seconds / work
            old = self.seconds_per_unit
            self.seconds_per_unit = rate if old == 0.0 else 0.5 * (old + rate)

    def tokens_within(self, sched, seconds: float) -> int:
        """The largest token budget for the next step that should end within ``seconds``:
        one token for every running request plus a prefill chunk of B tokens at the deepest
        prompt position now pending (a quadratic in B). -1: not even the decodes fit."""
        if self.seconds_per_unit == 0.0:
            return 1 << 30  # nothing measured yet: no basis to shrink
        units = seconds * _SAFETY / self.seconds_per_unit
        units -= sum(r.num_tokens + _MLP_TOKENS for r in sched.running)
        if units < 0:
            return -1
        pending = [r for r in sched.running if r.num_computed_tokens < r.num_prompt_tokens]
        pending += list(itertools.islice(sched.waiting, 1))
        depth = max((r.num_computed_tokens for r in pending), default=0) + _MLP_TOKENS
        chunk = int((-depth + math.sqrt(depth * depth + 4 * units)) / 2)
        return len(sched.running) + chunk


class AsyncLLM:
    def __init__(
        self,
        engine: LLMEngine | None = None,
        config: EngineConfig | None = None,
        max_pending: int | None = None,
    ) -> None:
        # The engine is built on the loop thread, so that only that thread ever runs OpenMP
        # parallel regions: a second thread's OpenMP team (the caller's, from loading the
        # weights) made libgomp count more threads than cores and stop spinning between
        # regions, and every GEMV of a step lost ~25% (batch-1 decode 23 -> 18 tok/s here).
        self._built = threading.Event()
        self._go = threading.Event()  # set once the attributes below exist
        self._build_error: BaseException | None = None
        self.engine: LLMEngine = engine  # type: ignore[assignment]
        self._thread = threading.Thread(
            target=self._run, args=(config,), name="engine-loop", daemon=True
        )
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.model_path = self.engine.model_path
        self.max_pending = max_pending or self.engine.config.scheduler.max_waiting
        self._commands: deque[Command] = deque()
        self._cv = threading.Condition()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._accepting = True
        self._stop = False
        self._deadline: float | None = None  # monotonic; the loop aborts everything at it
        self._meter = _StepMeter()
        self._full_budget = self.engine.scheduler.config
        self._error: BaseException | None = None
        self._go.set()

    # -- the interface ----------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (one per step it moves; the last has finished=True).
        ``priority``: vLLM's (lower first) under the scheduling policy "priority"; else 0.

        Raises RequestError (a ValueError naming the field) for invalid input, QueueFullError
        when the admission queue is full, EngineShuttingDownError after shutdown began, before
        anything is queued."""
        params = params or SamplingParams()
        rid = request_id or f"async-{next(self._ids)}"
        queue = self._submit(prompt, params, rid, cache_salt, priority)
        finished = False
        try:
            while True:
                item = await queue.get()
                if item is _DONE:  # the engine no longer knew it, and had no output for it
                    raise IncompleteRequestError(f"request {rid!r} ended without its final output")
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._abort_now(rid)

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile the params' structured-output constraint, if any, on the compiler's pool
        (never on the caller's event loop), so that the engine loop finds it cached when it
        adds the request: a miss there would compile on the loop thread and hold up every
        request's next step. The servers await it before ``generate``. Raises RequestError naming
        the field (invalid, or not compiled within the compiler's deadline) and GrammarBusyError
        (too many compiles pending: retry later)."""
        so = params.structured_outputs
        if so is None:
            return
        compiler = self.engine._grammar_compiler
        if compiler is None:  # the first: xgrammar loads, the vocabulary is read (~1 s)
            compiler = await asyncio.to_thread(lambda: self.engine.grammar_compiler)
        await compiler.compile_async(so)

    async def abort(self, request_id: str) -> None:
        self._abort_now(request_id)

    def is_healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    async def health(self) -> None:
        if not self.is_healthy():
            raise EngineDeadError(f"engine loop is not running: {self._error!r}")

    def metrics(self) -> MetricsSnapshot:
        return self.engine.metrics_snapshot()

    @property
    def num_in_flight(self) -> int:
        return len(self._sinks)

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop admitting, let in-flight requests finish until ``timeout``, abort the rest, stop
        the loop. The deadline holds: the loop aborts between steps and never starts a step
        that its measured cost says would end after the deadline (prefill is chunked to fit),
        so callers get ``finish_reason="abort"`` within about ``timeout``. Calling it again
        (a second signal) can only bring the deadline closer."""
        self._accepting = False
        self.set_deadline(time.monotonic() + max(0.0, timeout))
        assert self._deadline is not None
        give_up = self._deadline + SHUTDOWN_GRACE_S
        while self._sinks and self.is_healthy() and time.monotonic() < give_up:
            await asyncio.sleep(0.02)
        await asyncio.to_thread(self.close)

    def set_deadline(self, deadline: float) -> None:
        """Abort every request at ``deadline`` (monotonic seconds); the earliest call wins."""
        self._accepting = False
        with self._cv:
            if self._deadline is None or deadline < self._deadline:
                self._deadline = deadline
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)

    # -- submission (caller's thread) --------------------------------------------------------

    def _submit(self, prompt, params, rid, cache_salt, priority=0) -> asyncio.Queue:
        if not self._accepting:
            raise EngineShuttingDownError("the engine is shutting down")
        if self._error is not None:
            raise EngineDeadError(f"engine loop died: {self._error!r}")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        self.engine.validate(ids, params, priority)  # reads only config: safe from any thread
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._cv:
            if rid in self._sinks:
                raise RequestError(f"request_id {rid!r} is already in use", "request_id")
            if len(self._sinks) >= self.max_pending:
                raise QueueFullError(
                    f"too many requests in flight ({self.max_pending}); retry later"
                )
            self._sinks[rid] = (loop, queue)
            self._commands.append(AddRequest(rid, ids, text, params, cache_salt, priority))
            self._cv.notify()
        return queue

    def _abort_now(self, rid: str) -> None:
        with self._cv:
            if rid in self._sinks:
                self._commands.append(AbortRequest(rid))
                self._cv.notify()

    # -- the loop (engine thread) ------------------------------------------------------------

    def _deliver(self, rid: str, item, last: bool) -> None:
        sink = self._sinks.get(rid)
        if sink is None:
            return
        if last:
            with self._cv:
                self._sinks.pop(rid, None)
        loop, queue = sink
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the caller's event loop is closed; nobody is listening
            pass

    def _apply_commands(self) -> None:
        with self._cv:
            commands, self._commands = self._commands, deque()
        for cmd in commands:
            if isinstance(cmd, AddRequest):
                self._add(cmd)
            elif isinstance(cmd, AbortRequest):
                self._abort_in_engine(cmd.request_id)
            else:
                raise TypeError(f"not an engine-thread command: {cmd!r}")

    def _add(self, cmd: AddRequest) -> None:
        rid = cmd.request_id
        if rid not in self._sinks:
            return  # aborted before it was added
        try:
            self.engine.add_request(
                cmd.prompt_token_ids,
                cmd.params,
                request_id=rid,
                cache_salt=cmd.cache_salt,
                prompt_text=cmd.prompt_text,
                priority=cmd.priority,
            )
        except Exception as exc:  # validation races, queue full: tell the caller
            self._deliver(rid, exc, last=True)

    def _fit_step_to_deadline(self) -> bool:
        """Before a step while draining: shrink the step's token budget so that it ends before
        the deadline; False when no useful step fits (then abort everything now)."""
        assert self._deadline is not None
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            return False
        sched = self.engine.scheduler
        fits = self._meter.tokens_within(sched, remaining)
        if fits < max(1, len(sched.running)):
            return False
        budget = min(self._full_budget.max_num_batched_tokens, fits)
        if budget != sched.config.max_num_batched_tokens:
            # The scheduler reads its budget each step; a copy of its frozen config changes it.
            sched.config = dataclasses.replace(self._full_budget, max_num_batched_tokens=budget)
        return True

    def _abort_in_engine(self, rid: str) -> None:
        """Abort ``rid`` in the engine; its final output ("abort") goes out with the next step.
        One the engine ended already (aborted twice) has its final output pending: the caller
        gets that. Only a request the engine has no trace of closes its caller's stream."""
        if self.engine.abort_request(rid):
            return
        if not any(out.request_id == rid for out in self.engine.out.pending):
            self._deliver(rid, _DONE, last=True)

    def _abort_all(self) -> None:
        for rid in list(self._sinks):
            self._abort_in_engine(rid)
        for out in self.engine.step():  # only the pending abort outputs: nothing is left to run
            self._deliver(out.request_id, out, last=out.finished)

    def _step(self) -> None:
        before = self._meter.snapshot(self.engine.scheduler)
        t0 = time.perf_counter()
        outs = self.engine.step()
        self._meter.observe(before, time.perf_counter() - t0)
        for out in outs:
            self._deliver(out.request_id, out, last=out.finished)

    def _run(self, config: EngineConfig | None) -> None:
        try:
            if self.engine is None:
                self.engine = LLMEngine(config or EngineConfig())
        except BaseException as exc:  # raised again by __init__, on the caller's thread
            self._build_error = exc
            return
        finally:
            self._built.set()
        self._go.wait()
        self._loop()

    def _loop(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (
                        self._commands or self._stop or self.engine.has_unfinished_requests()
                    ):
                        self._cv.wait(timeout=1.0)
                    if self._stop:
                        break
                self._apply_commands()
                if self._deadline is not None and not self._fit_step_to_deadline():
                    self._abort_all()
                    continue
                self._step()
        except BaseException as exc:  # a bug in a step: fail everyone loudly, never hang them
            self._error = exc
            for rid in list(self._sinks):
                self._deliver(rid, EngineDeadError(f"engine loop died: {exc!r}"), last=True)
            raise
        finally:
            for rid in list(self._sinks):
                self._deliver(rid, EngineShuttingDownError("the engine stopped"), last=True)
            self.engine.close()
