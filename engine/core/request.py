"""A request's state as it moves through the engine: waiting, running, (preempted), finished."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.core.detokenizer import IncrementalDetokenizer
    from engine.structured.grammar import SequenceGrammar
from engine.outputs import PromptLogprobs, RequestMetrics, TokenLogprob
from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    LOADING_KV = "loading_kv"  # holds blocks while a KV connector fills them; not scheduled
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    """One sequence to generate. ``all_token_ids`` = prompt + output; the scheduler advances
    ``num_computed_tokens`` (tokens whose KV is in the cache) towards ``len(all_token_ids)``."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        detokenizer: IncrementalDetokenizer,
        prompt: str | None = None,
        cache_salt: str | None = None,
        generator: torch.Generator | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        # Under the "priority" scheduling policy: lower values are served first, and preempted
        # last (engine/core/scheduler.py); under "fcfs" always 0.
        self.priority = priority
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.detokenizer = detokenizer
        self.extra_keys: tuple = (cache_salt,) if cache_salt else ()
        self.generator = generator
        # The sequence's place in its structured-output grammar (engine/structured/grammar.py).
        self.grammar: SequenceGrammar | None = None
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.skip_kv_connector = False  # a load from the connector failed: recompute instead
        # Speculative decoding (engine/spec/): this step's draft tokens (set before scheduling,
        # never in all_token_ids; those kept are appended as output) and the sequence's
        # proposer state and draft budget (engine/spec/decoder.py SeqSpec), made on first use.
        self.spec_token_ids: list[int] = []
        self.spec = None
        # Pipeline stages (engine/core/stage_io.py). ``ready_tokens``: the prompt tokens whose
        # stage inputs (the stage before's hidden states) are here, None: all; the scheduler
        # never runs the request past it, and the caller raises it as inputs arrive.
        # ``prefix_tokens``: use at most this many tokens of a device prefix-cache hit (whole
        # blocks); with ``prefix_exact`` the request must start at exactly that many cached
        # tokens (else it ends at admission: "abort", stop reason "prefix_missing").
        self.ready_tokens: int | None = None
        self.prefix_tokens: int | None = None
        self.prefix_exact = False
        self.status = RequestStatus.WAITING
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        # Filled by position as prefill chunks run (a recompute after preemption rewrites the
        # same values); None when not asked for. Such a request skips the prefix cache.
        self.prompt_logprobs: PromptLogprobs | None = (
            [None] * len(self.prompt_token_ids) if params.prompt_logprobs is not None else None
        )
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.monotonic())
        self.load_started = 0.0  # when its latest KV load began (monotonic; the scheduler's)
        # Streaming cursors: what has been handed to the caller already.
        self.text_limit: int | None = None  # output text is cut here (a stop string matched)
        self.sent_text_len = 0
        self.sent_tokens = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
