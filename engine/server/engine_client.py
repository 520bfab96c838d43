"""The narrow interface the servers talk to: submit and stream, abort, health, metrics, shutdown.

``engine.async_llm.AsyncLLM`` (one engine in this process) satisfies it; a cluster client that
sends requests to remote prefill and decode instances can satisfy it too, and then replaces the
in-process engine without a change to the HTTP or RPC code. Structural typing: an implementation
does not import this module.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from engine.core.metrics import MetricsSnapshot
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    tokenizer: object  # encode / decode / apply_chat_template / eos_token_ids
    max_model_len: int
    model_path: str

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; closing the iterator early aborts the request.
        ``priority``: vLLM's, lower served first under the scheduling policy "priority" (a
        RequestError naming it when not an int, or not 0 under "fcfs"). Raises
        RequestError (400: bad input, naming the field; engine/errors.py), QueueFullError (429),
        EngineShuttingDownError (503); anything else is a 500."""
        ...

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile the params' structured-output constraint (if any) off the event loop, before
        ``generate``. Raises RequestError naming the field (invalid, does not compile, or not
        within the deadline) and GrammarBusyError (503: too many compiles pending)."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def is_healthy(self) -> bool: ...

    async def health(self) -> None: ...

    def metrics(self) -> MetricsSnapshot: ...

    async def shutdown(self, timeout: float = 30.0) -> None: ...
