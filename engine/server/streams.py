"""One API request may hold several engine requests (a list of prompts): start them together,
merge their outputs, and abort them all when the caller goes away.

Starting waits for each request's first output, so that admission errors (bad input 400, queue
full 429, shutting down 503) surface before a streamed response has sent its headers.

Every engine request's outputs pass ``checked``: one whose outputs stop before a finished one,
or whose choice ends with a finish reason that is no answer (an engine's own, such as
``handed_over`` or ``stage_done``), raises IncompleteRequestError (503) before anything of
that output reaches the client.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

from engine.async_llm import IncompleteRequestError
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

_END = object()
MERGE_QUEUE_SIZE = 64  # outputs buffered between the per-prompt pumps and the response writer
# What a choice may end with in front of a client: OpenAI's (the servers make "tool_calls" of a
# "stop" whose reply holds calls) and vLLM's "abort", for a request cancelled by its caller or by
# the server's shutdown (a whole response refuses the latter: engine/server/openai_serving.py).
PUBLIC_FINISH_REASONS = ("stop", "length", "abort")


def ending_problem(out: RequestOutput) -> str | None:
    """What makes ``out`` no part of an answer for a client: a choice ended with a finish reason
    of the engine's own. None if nothing."""
    for c in out.outputs:
        if c.finish_reason is not None and c.finish_reason not in PUBLIC_FINISH_REASONS:
            why = f" ({str(c.stop_reason)[:40]})" if c.stop_reason is not None else ""
            return f"choice {c.index} ended with {str(c.finish_reason)[:40]!r}{why}, not an answer"
    return None


def moved_once(c: CompletionOutput, index: int, ended: set[int]) -> bool:
    """Whether choice ``c`` (``index`` in the response) has something to stream: new tokens or
    text, or its finish reason, once. A choice that ended before the others of its request is
    in every later output of it, finished and with nothing new; ``ended`` notes the choices
    whose last chunk went out."""
    if index in ended:
        return False
    if c.finish_reason is not None:
        ended.add(index)
    return bool(c.new_token_ids or c.new_text or c.finish_reason)


def check_whole(out: RequestOutput, request_id: str) -> None:
    """A whole (not streamed) response's final output: a choice the server aborted (its
    shutdown's deadline passed) is no answer, and no partial answer is sent as a 200;
    IncompleteRequestError (503: retry it) instead."""
    for c in out.outputs:
        if c.finish_reason == "abort":
            raise IncompleteRequestError(
                f"request {request_id} was aborted before its answer was complete (the server "
                "is shutting down); retry it"
            )


async def checked(
    gen: AsyncIterator[RequestOutput], request_id: str
) -> AsyncIterator[RequestOutput]:
    """``gen``'s outputs, each checked by ``ending_problem``, up to and with the finished one;
    IncompleteRequestError if one fails the check or ``gen`` ends before a finished output.
    Closing this closes ``gen`` (which aborts the engine request)."""
    finished = False
    async with aclosing(gen):
        async for out in gen:
            problem = ending_problem(out)
            if problem is not None:
                raise IncompleteRequestError(f"request {request_id}: {problem}")
            finished = out.finished
            yield out
    if not finished:
        raise IncompleteRequestError(f"request {request_id} ended without its final output")


class RequestStreams:
    """The engine requests of one API request; iterate for ``(prompt_index, output)``."""

    def __init__(self, gens: list[AsyncIterator[RequestOutput]], firsts: list[RequestOutput]):
        self._gens = gens
        self._firsts = firsts
        self._tasks: list[asyncio.Task] = []

    @classmethod
    async def start(
        cls,
        llm,
        prompts: list[list[int]],
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> RequestStreams:
        ids = (
            [request_id]
            if len(prompts) == 1
            else [f"{request_id}-{i}" for i in range(len(prompts))]
        )
        gens = [
            checked(
                llm.generate(p, params, request_id=r, cache_salt=cache_salt, priority=priority),
                r,
            )
            for p, r in zip(prompts, ids)
        ]
        if len(gens) == 1:
            try:
                return cls(gens, [await anext(gens[0])])
            except BaseException:
                await gens[0].aclose()
                raise
        tasks = [asyncio.ensure_future(anext(g)) for g in gens]
        try:
            firsts = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for g in gens:
                await g.aclose()
            raise
        return cls(gens, list(firsts))

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if len(self._gens) == 1:
            first = self._firsts[0]
            yield 0, first
            if not first.finished:
                async for out in self._gens[0]:
                    yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue(MERGE_QUEUE_SIZE)
        self._tasks = [
            asyncio.ensure_future(self._pump(i, g, f, queue))
            for i, (g, f) in enumerate(zip(self._gens, self._firsts))
        ]
        remaining = len(self._tasks)
        while remaining:
            item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item

    @staticmethod
    async def _pump(i: int, gen, first: RequestOutput, queue: asyncio.Queue) -> None:
        try:
            await queue.put((i, first))
            if not first.finished:
                async for out in gen:
                    await queue.put((i, out))
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put(exc)
        await queue.put(_END)

    async def aclose(self) -> None:
        """Abort whatever is still running and free its KV blocks. Idempotent."""
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for g in self._gens:
            await g.aclose()
