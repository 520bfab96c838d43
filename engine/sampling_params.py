"""Per-request sampling parameters, validated where they are made (vLLM's names and ranges)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import RequestError
from engine.structured.params import StructuredOutputs

# The sampler works in float32: a larger temperature or penalty becomes inf there (and then
# NaN next to a masked -inf logit), so it is refused here.
FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. ``temperature == 0`` means greedy.

    Invalid values raise ``RequestError`` (a ValueError) naming the field and its limit.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return besides the chosen token's
    # vLLM's prompt_logprobs: for every prompt token after the first, its logprob and rank, and
    # this many top alternatives (RequestOutput.prompt_logprobs). Such a request bypasses the
    # prefix cache: a cached prefix was never run through the model here, so it has no logits.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # What the output must match (a JSON schema, any JSON object, a regex, a choice, a grammar):
    # a StructuredOutputs, or a map of its fields. See engine/structured/params.py.
    structured_outputs: StructuredOutputs | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        # Accept lists/str for convenience, store tuples so the object stays hashable and frozen.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.structured_outputs is not None:
            so = StructuredOutputs.from_dict(self.structured_outputs)
            object.__setattr__(self, "structured_outputs", so)
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, name: str, limit: str, value) -> None:
            if not ok:
                raise RequestError(f"{name} must be {limit}, got {value!r}", name)

        def is_num(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        check(is_int(self.n) and self.n >= 1, "n", ">= 1", self.n)
        check(
            is_num(self.temperature) and 0 <= self.temperature <= FLOAT32_MAX,
            "temperature",
            f"a number in [0, {FLOAT32_MAX:.8g}] (float32, the sampler's precision)",
            self.temperature,
        )
        check(is_num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]", self.top_p)
        check(
            is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1),
            "top_k",
            "-1, 0 (disabled) or >= 1",
            self.top_k,
        )
        check(is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]", self.min_p)
        check(
            is_num(self.repetition_penalty) and 0 < self.repetition_penalty <= FLOAT32_MAX,
            "repetition_penalty",
            f"in (0, {FLOAT32_MAX:.8g}] (float32, the sampler's precision)",
            self.repetition_penalty,
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(is_num(value) and -2.0 <= value <= 2.0, name, "in [-2, 2]", value)
        check(self.seed is None or is_int(self.seed), "seed", "an integer or None", self.seed)
        check(
            is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", ">= 1", self.max_tokens
        )
        check(
            is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"in [0, max_tokens={self.max_tokens}]",
            self.min_tokens,
        )
        check(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "a list of non-empty strings",
            self.stop,
        )
        check(
            all(is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "a list of token ids >= 0",
            self.stop_token_ids,
        )
        check(
            self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= 20),
            "logprobs",
            "None or in [0, 20]",
            self.logprobs,
        )
        check(
            self.prompt_logprobs is None
            or (is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
            "prompt_logprobs",
            "None or in [0, 20]",
            self.prompt_logprobs,
        )
        check(
            self.structured_outputs is None or self.min_tokens == 0,
            "min_tokens",
            "0 with structured_outputs (the grammar decides where the output may end)",
            self.min_tokens,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
