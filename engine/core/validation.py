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


PRIORITY_MIN, PRIORITY_MAX = -(2**63), 2**63 - 1  # what every wire (msgpack, JSON ints) carries


def validate_priority(priority: object, policy: str) -> None:
    """A request's ``priority`` (an int, lower served first, 0 by default) under the scheduling
    policy ``policy`` ("fcfs" or "priority"): RequestError naming ``priority``. Under fcfs only
    the default 0 is taken, as vLLM refuses it ("priority scheduling is not enabled")."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise RequestError(
            f"priority must be an integer, got {type(priority).__name__} {priority!r}", "priority"
        )
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise RequestError(f"priority must be in [-2**63, 2**63 - 1], got {priority}", "priority")
    if priority != 0 and policy != "priority":
        raise RequestError(
            f"priority {priority} was given but priority scheduling is not enabled (the "
            f"scheduling policy is {policy}; start the server with --scheduling-policy "
            "priority), so priority must be 0",
            "priority",
        )


def validate_stage_fields(
    num_prompt: int, ready: int | None, prefix: int | None, exact: bool, block_size: int
) -> None:
    """A pipeline stage's fields of a request (engine/core/stage_io.py): ValueError naming the
    field and the limit."""
    for name, value in (("ready_tokens", ready), ("prefix_tokens", prefix)):
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 0
        ):
            raise ValueError(f"{name} must be None or an int >= 0, got {value!r}")
    if ready is not None and ready > num_prompt:
        raise ValueError(f"ready_tokens ({ready}) must be <= the prompt's {num_prompt} tokens")
    if exact and (prefix is None or prefix % block_size or prefix >= num_prompt):
        raise ValueError(
            "prefix_exact needs prefix_tokens, a multiple of the block size "
            f"({block_size}) shorter than the prompt ({num_prompt} tokens), got {prefix!r}"
        )


def cap_for_tests(params: SamplingParams) -> SamplingParams:
    """``params`` with max_tokens (and min_tokens) at most ENGINE_TEST_MAX_TOKENS, a test-only
    cap (engine/envs.py), applied after validation so that it never changes what is refused."""
    cap = envs.test_max_tokens()
    if cap is None or params.max_tokens <= cap:
        return params
    return dataclasses.replace(params, max_tokens=cap, min_tokens=min(params.min_tokens, cap))
