"""One API request may hold several engine requests (a list of prompts): start them together,
merge their outputs, and abort them all when the caller goes away.

Starting waits for each request's first output, so that admission errors (bad input 400, queue
full 429, shutting down 503) surface before a streamed response has sent its headers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

_END = object()
MERGE_QUEUE_SIZE = 64  # outputs buffered between the per-prompt pumps and the response writer


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
            llm.generate(p, params, request_id=r, cache_salt=cache_salt, priority=priority)
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
