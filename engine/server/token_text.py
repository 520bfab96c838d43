"""A token's text and bytes as the OpenAI logprobs report them, cached per token id."""

from __future__ import annotations

import functools
import re

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


def clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class TokenText:
    """Token ids -> their text (special tokens spelled out) and their own bytes."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._str: dict[int, str] = {}  # bounded by the vocabulary
        self._bytes: dict[int, bytes] = {}
        self.special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()))

    def str(self, token_id: int) -> str:
        s = self._str.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._str[token_id] = s
        return s

    def bytes(self, token_id: int) -> bytes:
        """The token's own bytes. A byte-level token that holds part of a multi-byte character
        decodes to U+FFFD alone; its bytes are read from its vocabulary spelling instead, so
        that joining the tokens' bytes rebuilds the text (what OpenAI's ``bytes`` is for)."""
        b = self._bytes.get(token_id)
        if b is None:
            text = self.str(token_id)
            b = text.encode()
            if "\ufffd" in text:
                piece = self.tokenizer.convert_ids_to_tokens([token_id])[0]
                b = _piece_bytes(piece) or b
            self._bytes[token_id] = b
        return b


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's map from the characters that spell bytes in a byte-level vocabulary to bytes."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _piece_bytes(piece: str | None) -> bytes | None:
    """Bytes of a vocabulary piece: SentencePiece's byte fallback ``<0xE2>``, or a byte-level
    BPE piece; None if it is neither."""
    if piece is None:
        return None
    m = _BYTE_PIECE.fullmatch(piece)
    if m:
        return bytes([int(m.group(1), 16)])
    alphabet = _byte_level_alphabet()
    if all(c in alphabet for c in piece):
        return bytes(alphabet[c] for c in piece)
    return None
