"""Streaming detokenization: text deltas as tokens arrive, one request at a time.

Decoding each token alone is wrong: a character may be split across tokens (UTF-8 bytes in a
byte-level vocabulary, byte-fallback tokens in SentencePiece), and a token's text can depend on
its neighbour (SentencePiece drops the leading space of the first token). So, as vLLM's
``detokenize_incrementally`` does, we decode a short window ``ids[prefix_offset:]`` and emit what
it adds beyond ``ids[prefix_offset:read_offset]``, the part already emitted. Text is held back
while it ends in U+FFFD (an incomplete character), so half characters are never emitted.

Invariant: after ``flush()``, ``text == tokenizer.decode(all ids, skip_special_tokens)``.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.model.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        # ids[prefix_offset:read_offset] decode to text that has been emitted in full; the window
        # to decode starts at prefix_offset so that tokens after it see their left neighbour.
        self.prefix_offset = 0
        self.read_offset = 0
        self._skipped = set(tokenizer.all_special_ids) if skip_special_tokens else set()

    def add_tokens(self, ids: Iterable[int]) -> str:
        """Append token ids; return the text they add (possibly "" while a character is
        incomplete). ``self.text`` is the concatenation of all deltas."""
        delta = []
        for token_id in ids:
            self.token_ids.append(token_id)
            delta.append(self._step())
        out = "".join(delta)
        self.text += out
        return out

    def flush(self) -> str:
        """Emit what is held back at the end of the stream (an incomplete character decodes to
        U+FFFD, as decode() of all ids would give)."""
        prefix = self._decode(self.prefix_offset, self.read_offset)
        rest = self._decode(self.prefix_offset, len(self.token_ids))[len(prefix) :]
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text += rest
        return rest

    def _step(self) -> str:
        if self.token_ids[-1] in self._skipped and self.read_offset == len(self.token_ids) - 1:
            # A skipped special token adds no text; do not let it hold a window open.
            self.read_offset += 1
            return ""
        prefix = self._decode(self.prefix_offset, self.read_offset)
        window = self._decode(self.prefix_offset, len(self.token_ids))
        if len(window) <= len(prefix) or window.endswith(_REPLACEMENT):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return window[len(prefix) :]

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self.tokenizer.decode(
            self.token_ids[start:end], skip_special_tokens=self.skip_special_tokens
        )
