"""An asyncio front for one engine: many concurrent callers, one engine loop thread.

The engine is owned by a single background thread. Callers submit commands (add, abort) through
a bounded queue; the loop applies them between steps and pushes each step's outputs to the
callers' asyncio queues with ``call_soon_threadsafe``. Closing a ``generate`` iterator early (a
client that disconnects) aborts the request and frees its KV blocks.

This is the narrow interface the servers use (submit/stream, abort, health, metrics); a cluster
client can offer the same methods.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import AsyncIterator

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.metrics import MetricsSnapshot
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import QueueFullError


class EngineDeadError(RuntimeError):
    """The engine loop died; requests in flight fail with this."""


class EngineShuttingDownError(RuntimeError):
    """The engine no longer admits requests (HTTP 503)."""


_DONE = object()


class AsyncLLM:
    def __init__(
        self,
        engine: LLMEngine | None = None,
        config: EngineConfig | None = None,
        max_pending: int | None = None,
    ) -> None:
        self.engine = engine or LLMEngine(config or EngineConfig())
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.model_path = self.engine.model_path
        self.max_pending = max_pending or self.engine.config.scheduler.max_waiting
        self._commands: deque = deque()
        self._cv = threading.Condition()
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._accepting = True
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
        self._thread.start()

    # -- the interface ----------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (one per step it moves; the last has finished=True).

        Raises ValueError for invalid input, QueueFullError when the admission queue is full,
        EngineShuttingDownError after shutdown began, before anything is queued."""
        params = params or SamplingParams()
        rid = request_id or f"async-{next(self._ids)}"
        queue = self._submit(prompt, params, rid, cache_salt)
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
                self._abort_now(rid)

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
        """Stop admitting, let in-flight requests finish until ``timeout``, abort the rest,
        stop the loop."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._sinks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self._sinks):
            self._abort_now(rid)
        # Let the loop apply those aborts (callers get finish_reason "abort", not an error).
        deadline = time.monotonic() + 5.0
        while self._sinks and self.is_healthy() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)

    # -- submission (caller's thread) --------------------------------------------------------

    def _submit(self, prompt, params, rid, cache_salt) -> asyncio.Queue:
        if not self._accepting:
            raise EngineShuttingDownError("the engine is shutting down")
        if self._error is not None:
            raise EngineDeadError(f"engine loop died: {self._error!r}")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        self.engine.validate(ids, params)  # reads only config: safe from any thread
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._cv:
            if rid in self._sinks:
                raise ValueError(f"request_id {rid!r} is already in use")
            if len(self._sinks) >= self.max_pending:
                raise QueueFullError(
                    f"too many requests in flight ({self.max_pending}); retry later"
                )
            self._sinks[rid] = (loop, queue)
            self._commands.append(("add", rid, ids, text, params, cache_salt))
            self._cv.notify()
        return queue

    def _abort_now(self, rid: str) -> None:
        with self._cv:
            if rid in self._sinks:
                self._commands.append(("abort", rid))
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
            if cmd[0] == "add":
                _, rid, ids, text, params, salt = cmd
                if rid not in self._sinks:
                    continue  # aborted before it was added
                try:
                    self.engine.add_request(
                        ids, params, request_id=rid, cache_salt=salt, prompt_text=text
                    )
                except Exception as exc:  # validation races, queue full: tell the caller
                    self._deliver(rid, exc, last=True)
            else:
                rid = cmd[1]
                if not self.engine.abort_request(rid):
                    self._deliver(rid, _DONE, last=True)

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
                for out in self.engine.step():
                    self._deliver(out.request_id, out, last=out.finished)
        except BaseException as exc:  # a bug in a step: fail everyone loudly, never hang them
            self._error = exc
            for rid in list(self._sinks):
                self._deliver(rid, EngineDeadError(f"engine loop died: {exc!r}"), last=True)
            raise
        finally:
            for rid in list(self._sinks):
                self._deliver(rid, EngineShuttingDownError("the engine stopped"), last=True)
            self.engine.close()
