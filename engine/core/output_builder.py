"""What the caller is handed: a ``RequestOutput`` per request that moved, built in one place for
the engine (from its ``Request``s) and the cluster router (from the choices its workers stream).

Each choice keeps two streaming cursors, ``sent_tokens`` and ``sent_text_len``: what the caller
has seen. Building an output reports everything so far plus the delta since those cursors, then
moves them, so a caller that reads only the ``new_*`` fields sees every token and character once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from engine.outputs import (
    CompletionOutput,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)


class StreamedChoice(Protocol):
    """One choice as it streams (the engine's ``Request``; the router's per-choice state)."""

    output_token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    cumulative_logprob: float
    finish_reason: str | None
    stop_reason: int | str | None
    sent_tokens: int  # cursors: what the caller has been handed
    sent_text_len: int


def take_completion(
    index: int, choice: StreamedChoice, text: str, visible: int | None = None
) -> CompletionOutput:
    """Choice ``index`` so far, ``text`` shown up to ``visible`` characters (all of it by
    default; a tail that may begin a stop string is held back by passing less), and what is new
    since its cursors, which move to the end of what this output shows."""
    visible = len(text) if visible is None else visible
    visible = max(visible, choice.sent_text_len)  # what was shown is never taken back
    ids, lps = choice.output_token_ids, choice.logprobs
    out = CompletionOutput(
        index=index,
        text=text[:visible],
        token_ids=list(ids),
        logprobs=lps,
        cumulative_logprob=choice.cumulative_logprob,
        finish_reason=choice.finish_reason,
        stop_reason=choice.stop_reason,
        new_text=text[choice.sent_text_len : visible],
        new_token_ids=ids[choice.sent_tokens :],
        new_logprobs=None if lps is None else lps[choice.sent_tokens :],
    )
    choice.sent_text_len, choice.sent_tokens = visible, len(ids)
    return out


def build_output(
    request_id: str,
    prompt: str | None,
    prompt_token_ids: list[int],
    choices: Sequence[tuple[StreamedChoice, str, int | None]],
    finished: bool,
    metrics: RequestMetrics | None,
    prompt_logprobs: PromptLogprobs | None = None,
) -> RequestOutput:
    """A request's output from its choices, each (choice, its text, visible characters or
    None for all); moves every choice's cursors (``take_completion``)."""
    outs = [take_completion(i, c, text, visible) for i, (c, text, visible) in enumerate(choices)]
    return RequestOutput(
        request_id,
        prompt,
        prompt_token_ids,
        outs,
        finished=finished,
        metrics=metrics,
        prompt_logprobs=prompt_logprobs,
    )
