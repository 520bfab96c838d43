"""When a sequence stops, checked after each new token. Pure functions: no state, no tokenizer.

Precedence when several hold on the same token (vLLM's): EOS, then stop token ids, then stop
strings, then max_tokens. So a sequence whose last allowed token is EOS or completes a stop string
finishes with "stop", not "length". While ``num_output_tokens <= min_tokens`` only max_tokens can
end it (the sampler also masks EOS and stop token ids until then).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal, NamedTuple

from engine.sampling_params import SamplingParams


class StopResult(NamedTuple):
    finished: bool
    finish_reason: Literal["stop", "length"] | None
    # The stop token id or stop string that ended it; None for EOS, max_tokens or not finished.
    stop_reason: int | str | None
    # Keep text[:truncate_to]; set only when a stop string matched (it may equal len(text)).
    truncate_to: int | None


NOT_FINISHED = StopResult(False, None, None, None)
_LENGTH = StopResult(True, "length", None, None)


def check_stop(
    params: SamplingParams,
    token_id: int,
    num_output_tokens: int,
    eos_token_ids: Collection[int],
    text: str,
    new_text_len: int,
) -> StopResult:
    """Whether the sequence ends with ``token_id``, its ``num_output_tokens``-th output token.

    ``text`` is the output text so far, including the ``new_text_len`` characters this token added.
    """
    if num_output_tokens > params.min_tokens:
        if not params.ignore_eos and token_id in eos_token_ids:
            return StopResult(True, "stop", None, None)
        if token_id in params.stop_token_ids:
            return StopResult(True, "stop", token_id, None)
        if params.stop:
            match = find_stop_string(text, new_text_len, params.stop)
            if match is not None:
                start, stop = match
                end = start + len(stop) if params.include_stop_str_in_output else start
                return StopResult(True, "stop", stop, end)
    if num_output_tokens >= params.max_tokens:
        return _LENGTH
    return NOT_FINISHED


def find_stop_string(text: str, new_text_len: int, stop: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest stop string that ends inside the last ``new_text_len`` characters: its start
    and itself (the longest one if several start there). Earlier text was checked on earlier
    tokens, so only the last ``new_text_len + len(s) - 1`` characters are searched for ``s``."""
    if new_text_len <= 0:
        return None
    old_len = len(text) - new_text_len
    best: tuple[int, str] | None = None
    for s in stop:
        # A match must end after old_len, so it starts at or after old_len - len(s) + 1.
        i = text.find(s, max(0, old_len - len(s) + 1))
        if i >= 0 and (best is None or (i, -len(s)) < (best[0], -len(best[1]))):
            best = (i, s)
    return best


def safe_text_len(text: str, stop: tuple[str, ...]) -> int:
    """How much of ``text`` can be streamed now: all but the longest tail that is a proper prefix
    of some stop string, since a later token may complete it into a stop string that gets cut."""
    hold = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return len(text) - hold
