"""The proposer seam: given a sequence's tokens, guess up to ``k`` tokens that follow
(engine/spec/decoder.py ``make_proposer`` picks one of ngram.py, suffix.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any


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
