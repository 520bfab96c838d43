"""A request as the router holds it: what the client asked, where it is placed, which phase it is
in, and each choice's tokens and text as the workers stream them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from engine.outputs import RequestMetrics, TokenLogprob
from engine.sampling_params import SamplingParams

# "waiting": for room in a decode worker's KV staging area, placed again at phase_deadline
PHASES = ("new", "waiting", "reserving", "copying", "prefill", "decode")
DONE = object()  # the last item of a caller's queue when its request ended without an output


@dataclass
class Choice:
    """One choice, assembled from the workers' ``Outputs`` (engine/core/output_builder.py's
    ``StreamedChoice``)."""

    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_text_len: int = 0


@dataclass
class RouterRequest:
    request_id: str
    ids: list[int]
    prompt: str | None
    params: SamplingParams
    loop: asyncio.AbstractEventLoop  # the caller's: outputs go to ``queue`` through it
    queue: asyncio.Queue
    deadline: float
    choices: list[Choice]
    metrics: RequestMetrics
    priority: int = 0  # vLLM's (lower first): the Conductor's queues and the workers' order by it
    phase: str = "new"  # one of PHASES
    prefill: str = ""  # the prefill unit: a worker, or a group (``group:NAME``)
    decode: str = ""
    legs: tuple[str, ...] = ()  # the prefill unit's workers, in stage order (one alone)
    # per leg: it was proven to share the decode worker's /dev/shm when the decode worker was
    # told who writes into its staging area (a proof that comes later does not count: TCP)
    shm_legs: tuple[bool, ...] = ()
    attempts: int = 0
    waits: int = 0  # of the attempts, those refused for staging room (not counted as retries)
    phase_deadline: float = 0.0
    wire_id: str = ""  # the id workers know this attempt by: request id / attempt
    copy_wait: bool = False  # a block copy to its prefill worker is under way
    ready: tuple | None = None  # (decode worker, DecodeReady) while the copy finishes

    @property
    def streamed(self) -> bool:
        return any(c.output_token_ids for c in self.choices)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def deliver(self, item) -> None:
        """Hand the caller an output, an exception or DONE, from any thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the caller's loop is closed
