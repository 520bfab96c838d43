"""Speculative decoding's config (``EngineConfig.speculative``, ``--speculative``): plain values, a
leaf like engine/config.py, which re-exports it."""

from __future__ import annotations

from dataclasses import dataclass, fields

SPECULATIVE_METHODS = ("ngram", "suffix")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Draftless speculative decoding (engine/spec/): ``method`` None is off; "ngram" proposes the
    tokens that followed the latest earlier occurrence of the sequence's last n tokens (n from
    ``prompt_lookup_max`` down to ``prompt_lookup_min``: vLLM's prompt lookup); "suffix" follows
    the most frequent continuation of the longest matching suffix, in the request's own tokens
    and in the outputs of the last ``suffix_cache_requests`` requests (suffix decoding). At most
    ``num_speculative_tokens`` are proposed per sequence and step; ``adaptive`` lowers a
    sequence's number as its proposals are rejected, down to none, and raises it as they are
    accepted. Verification keeps the target distribution exactly (engine/spec/verify.py)."""

    method: str | None = None
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    suffix_cache_requests: int = 256
    suffix_max_depth: int = 24
    suffix_min_token_prob: float = 0.1
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)} (or none), "
                f"got {self.method!r}"
            )
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError(
                f"num_speculative_tokens must be in [1, 32], got {self.num_speculative_tokens}"
            )
        if self.prompt_lookup_min <= 0:
            raise ValueError(f"prompt_lookup_min must be > 0, got {self.prompt_lookup_min}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(
                f"prompt_lookup_max ({self.prompt_lookup_max}) must be >= prompt_lookup_min "
                f"({self.prompt_lookup_min})"
            )
        if self.suffix_cache_requests <= 0:
            raise ValueError(f"suffix_cache_requests must be > 0, got {self.suffix_cache_requests}")
        if not 2 <= self.suffix_max_depth <= 64:
            raise ValueError(f"suffix_max_depth must be in [2, 64], got {self.suffix_max_depth}")
        if not 0.0 <= self.suffix_min_token_prob < 1.0:
            raise ValueError(
                f"suffix_min_token_prob must be in [0, 1), got {self.suffix_min_token_prob}"
            )

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @classmethod
    def from_dict(cls, values: dict) -> SpeculativeConfig:
        """vLLM's ``speculative_config`` dict; ValueError naming a field it does not know."""
        known = {f.name for f in fields(cls)}
        for name in values:
            if name not in known:
                names = ", ".join(sorted(known))
                raise ValueError(f"speculative_config: unknown field {name!r} (known: {names})")
        return cls(**values)
