"""OpenAI's legacy completions logprobs: four lists, one entry per token, ``tokens``,
``token_logprobs``, ``top_logprobs`` (the token's text -> logprob of the top n and the token) and
``text_offset`` (characters of the choice's text before the token). With ``echo`` the prompt's
tokens come first, their entries from the engine's prompt logprobs; the first prompt token has
``null`` logprobs (nothing predicts it), as OpenAI's and vLLM's do."""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from engine.outputs import PromptLogprobs, TokenLogprob
from engine.server.token_text import TokenText, clamp

KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


class TextCursor:
    """Characters of text so far, fed token bytes: a token's ``text_offset`` is the number of
    whole characters before it (the bytes of a character split over tokens count once)."""

    def __init__(self, chars: int = 0) -> None:
        self.chars = chars
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, data: bytes) -> int:
        """The offset of a token with these bytes; then move past it."""
        at = self.chars
        self.chars += len(self._decoder.decode(data))
        return at


def _empty() -> dict[str, list]:
    return {key: [] for key in KEYS}


def _add(
    out: dict[str, list],
    text: TokenText,
    token_id: int,
    logprob: float,
    alternatives: Iterable[tuple[int, float]],
    k: int,
    offset: int,
) -> None:
    top = dict(sorted(alternatives, key=lambda kv: -kv[1])[:k])
    top.setdefault(token_id, logprob)
    out["tokens"].append(text.str(token_id))
    out["token_logprobs"].append(clamp(logprob))
    out["top_logprobs"].append({text.str(t): clamp(v) for t, v in top.items()})
    out["text_offset"].append(offset)


def generated_logprobs(
    text: TokenText, lps: list[TokenLogprob], k: int, cursor: TextCursor
) -> dict[str, list]:
    """The entries of generated tokens; ``cursor`` stands where they start in the text."""
    out = _empty()
    for lp in lps:
        offset = cursor.advance(text.bytes(lp.token_id))
        _add(out, text, lp.token_id, lp.logprob, lp.top.items(), k, offset)
    return out


def echoed_prompt_logprobs(
    text: TokenText,
    ids: list[int],
    entries: PromptLogprobs | None,
    k: int,
    echo_text: str,
) -> dict[str, list]:
    """The entries of the echoed prompt ``ids`` (whose text is ``echo_text``), from the engine's
    prompt logprobs. A special token that ``echo_text`` does not spell where it stands (a BOS
    the tokenizer added, one a decoded prompt skipped) takes no width."""
    if entries is None or len(entries) != len(ids):
        raise RuntimeError("the engine returned no prompt logprobs for an echo with logprobs")
    out = _empty()
    cursor = TextCursor()
    for token_id, entry in zip(ids, entries):
        offset = cursor.chars
        if token_id not in text.special_ids or echo_text.startswith(text.str(token_id), offset):
            cursor.advance(text.bytes(token_id))
        if entry is None:  # the first: nothing predicts it
            for key, value in zip(KEYS, (text.str(token_id), None, None, offset)):
                out[key].append(value)
            continue
        alternatives = ((t, e.logprob) for t, e in entry.items())
        _add(out, text, token_id, entry[token_id].logprob, alternatives, k, offset)
    return out


def joined(first: dict[str, list], then: dict[str, list]) -> dict[str, list]:
    return {key: first[key] + then[key] for key in KEYS}
