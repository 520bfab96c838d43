"""Prompt lookup (vLLM's "ngram", llama.cpp's ngram-simple): the sequence's last n tokens are
looked up among its earlier tokens, longest n first; the tokens that followed their latest
earlier occurrence are the proposal. Each n-gram size keeps a map from n-gram to the position
after its latest occurrence, extended incrementally as the sequence grows, so a step costs a few
dictionary operations per new token (and the prompt is indexed once, on its first proposal)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.spec.proposer import Proposer


class NgramState:
    __slots__ = ("indexed", "maps")

    def __init__(self, sizes: range) -> None:
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.indexed = 0  # n-grams ending before this position are in the maps


class NgramProposer(Proposer):
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_n}, {max_n}")
        self.sizes = range(max_n, min_n - 1, -1)  # longest first

    def new_state(self) -> NgramState:
        return NgramState(self.sizes)

    def propose(self, state: NgramState, tokens: Sequence[int], k: int) -> list[int]:
        end = len(tokens)
        if k <= 0 or end < 2:
            return []
        # Index the n-grams that end at positions (state.indexed, end - 1]: never the sequence's
        # own last n tokens (those are the key), so a match always has a token after it.
        for e in range(max(state.indexed, 1), end):
            for n, table in state.maps.items():
                if e >= n:
                    table[tuple(tokens[e - n : e])] = e
        state.indexed = end
        for n, table in state.maps.items():
            if end < n:
                continue
            start = table.get(tuple(tokens[end - n : end]))
            if start is not None:
                return list(tokens[start : min(start + k, end)])
        return []
