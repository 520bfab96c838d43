"""What a request must satisfy before it is queued, checked the same way by the engine, its
embedded front ends and the cluster router (which holds no engine), and the test-only cap on
``max_tokens``."""

from __future__ import annotations

import dataclasses

from engine import envs
from engine.errors import RequestError
from engine.sampling_params import SamplingParams


def validate_prompt(
    prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int
) -> None:
    """Raise RequestError naming the field and the limit; changes nothing."""
    n = len(prompt_token_ids)
    if n == 0:
        raise RequestError("prompt must not be empty", "prompt")
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"prompt token id {bad} is out of range [0, {vocab_size})", "prompt")
    if n >= max_model_len:
        raise RequestError(
            f"prompt (length {n}) is longer than the maximum model length of "
            f"{max_model_len} tokens (it must leave room for at least one output token)",
            "prompt",
        )
    if n + params.max_tokens > max_model_len:
        raise RequestError(
            f"max_tokens ({params.max_tokens}) is too large: the prompt has {n} tokens and "
            f"the maximum model length is {max_model_len}, so max_tokens must be <= "
            f"{max_model_len - n}",
            "max_tokens",
        )


def cap_for_tests(params: SamplingParams) -> SamplingParams:
    """``params`` with max_tokens (and min_tokens) at most ENGINE_TEST_MAX_TOKENS, a test-only
    cap (engine/envs.py), applied after validation so that it never changes what is refused."""
    cap = envs.test_max_tokens()
    if cap is None or params.max_tokens <= cap:
        return params
    return dataclasses.replace(params, max_tokens=cap, min_tokens=min(params.min_tokens, cap))
