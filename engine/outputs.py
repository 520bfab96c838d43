"""What the engine hands back: one RequestOutput per request per step while it streams."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    # Top-n alternatives here: token id -> logprob (includes the chosen one if it is in the top-n).
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class Logprob:
    """One entry of a prompt position's logprobs (vLLM's ``Logprob``)."""

    logprob: float
    rank: int  # 1 + the number of vocabulary tokens with a higher logprob
    decoded_token: str | None = None


# Per prompt token: None for the first (nothing predicts it), else token id -> Logprob for the
# prompt's own token and the top-k alternatives.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One generated sequence. ``text``/``token_ids`` are cumulative; ``new_*`` hold this step's
    delta."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float = 0.0
    # "stop" | "length" | "abort" (its caller, or the server's shutdown, aborted it) | "error"
    # (it failed: stop_reason says why, e.g. "grammar_refused"; the servers answer 503)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens not recomputed (device cache and KV pool)
    kv_sources: dict[str, int] = field(default_factory=dict)  # those tokens by source
    kv_load_time: float = 0.0  # s it waited for its KV loads (pool tiers, a P/D hand-over)
    num_computed_prompt_tokens: int = 0  # prompt tokens this engine actually ran through the model
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    prompt_logprobs: PromptLogprobs | None = None  # with SamplingParams.prompt_logprobs
