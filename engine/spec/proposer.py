"""The proposer seam: given a sequence's tokens, guess up to ``k`` tokens that follow."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from engine.config import SpeculativeConfig


class Proposer(ABC):
    """Proposes draft tokens for one sequence at a time. ``state`` is the proposer's per-sequence
    object (``new_state`` makes it; the caller keeps it with the sequence, so it goes when the
    sequence goes); ``tokens`` are the sequence's prompt and output so far, only ever appended
    to between calls."""

    @abstractmethod
    def new_state(self) -> Any: ...

    @abstractmethod
    def propose(self, state: Any, tokens: Sequence[int], k: int) -> list[int]:
        """At most ``k`` tokens guessed to follow ``tokens``; [] when there is no guess."""

    def finished(  # noqa: B027 (optional: most proposers keep nothing across sequences)
        self, state: Any, tokens: Sequence[int], num_prompt_tokens: int
    ) -> None:
        """A sequence ended normally (its output may help later ones). Default: nothing."""


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        from engine.spec.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        from engine.spec.suffix import SuffixProposer

        return SuffixProposer(
            config.suffix_max_depth, config.suffix_cache_requests, config.suffix_min_token_prob
        )
    raise ValueError(f"speculative method: no proposer for {config.method!r}")
