"""The embedded API on the real default model: sampling contracts, stop strings, streaming,
bad input (the engine keeps serving), n > 1, logprobs."""

from __future__ import annotations

import math

import pytest

from engine import LLM, SamplingParams
from engine.errors import RequestError


@pytest.fixture(scope="module")
def llm():
    return LLM("default", dtype="float32", device="cpu", num_blocks=256)


PROMPT = "Once upon a time, in a small village by the sea,"


def text(out) -> str:
    return out.outputs[0].text


def test_fixed_seed_reproducible_and_independent_of_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=16)
    a = llm.generate(PROMPT, p)[0].outputs[0].token_ids
    b = llm.generate(PROMPT, p)[0].outputs[0].token_ids
    # Same seed inside a batch with other (unseeded, sampled) requests: same tokens.
    mixed = llm.generate(
        ["Tell me a joke.", PROMPT, "Count to five."],
        [SamplingParams(temperature=1.0, max_tokens=8), p, SamplingParams(max_tokens=4)],
    )
    assert a == b == mixed[1].outputs[0].token_ids
    other = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=99, max_tokens=16))
    assert other[0].outputs[0].token_ids != a


def test_top_k_1_equals_greedy(llm):
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=16))
    top1 = llm.generate(PROMPT, SamplingParams(temperature=0.9, top_k=1, seed=5, max_tokens=16))
    assert greedy[0].outputs[0].token_ids == top1[0].outputs[0].token_ids


def test_stop_string_is_trimmed(llm):
    free = text(llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=24))[0])
    # Pick a stop string from the middle of the free-running output.
    words = free.split()
    assert len(words) > 4
    stop = words[3]
    cut = free.index(stop)
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]))[0]
    assert text(out) == free[:cut]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    kept = llm.generate(
        PROMPT,
        SamplingParams(
            temperature=0.0, max_tokens=24, stop=[stop], include_stop_str_in_output=True
        ),
    )[0]
    assert text(kept) == free[: cut + len(stop)]


def test_streaming_deltas_add_up_to_the_final_text(llm):
    p = SamplingParams(temperature=0.0, max_tokens=20)
    deltas = list(llm.stream(PROMPT, p))
    assert len(deltas) > 1
    assert "".join(deltas) == text(llm.generate(PROMPT, p)[0])


def test_max_tokens_and_ignore_eos(llm):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_test_only_max_tokens_cap(llm, monkeypatch):
    """ENGINE_TEST_MAX_TOKENS (the documentation's test sets it) caps max_tokens and min_tokens
    where a request is admitted, after validation: it never changes what is refused."""
    monkeypatch.setenv("ENGINE_TEST_MAX_TOKENS", "3")
    params = SamplingParams(max_tokens=12, min_tokens=8, ignore_eos=True)
    out = llm.generate(PROMPT, params)[0].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate("hi", SamplingParams(max_tokens=9000))
    monkeypatch.setenv("ENGINE_TEST_MAX_TOKENS", "0")
    with pytest.raises(ValueError, match="ENGINE_TEST_MAX_TOKENS"):
        llm.generate(PROMPT, params)
    monkeypatch.delenv("ENGINE_TEST_MAX_TOKENS")
    assert len(llm.generate(PROMPT, params)[0].outputs[0].token_ids) == 12


def test_n_and_logprobs(llm):
    out = llm.generate(
        PROMPT, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, logprobs=3)
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        for tok, lp in zip(c.token_ids, c.logprobs):
            assert lp.token_id == tok and lp.logprob <= 0.0
            assert len(lp.top) >= 3
            tops = sorted(lp.top.values(), reverse=True)
            assert lp.logprob <= tops[0] + 1e-6
        assert math.isclose(c.cumulative_logprob, sum(lp.logprob for lp in c.logprobs))


def test_chat_uses_the_template(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=16),
    )[0]
    assert "Paris" in text(out)
    assert out.prompt_token_ids[:1] == llm.tokenizer.encode("<|im_start|>", False)


@pytest.mark.parametrize(
    "make, field, param",
    [
        (lambda llm: llm.generate("", SamplingParams()), "prompt", "prompt"),
        (lambda llm: llm.generate([[]], SamplingParams()), "prompt", "prompt"),
        (
            lambda llm: llm.generate([1] * 9000, SamplingParams()),
            "maximum model length",
            "prompt",
        ),
        (
            lambda llm: llm.generate("hi", SamplingParams(max_tokens=9000)),
            "max_tokens",
            "max_tokens",
        ),
        (
            lambda llm: llm.generate("hi", SamplingParams(max_tokens=0)),
            "max_tokens",
            "max_tokens",
        ),
        (
            lambda llm: llm.generate("hi", SamplingParams(temperature=-1)),
            "temperature",
            "temperature",
        ),
        (lambda llm: llm.generate("hi", SamplingParams(top_p=0.0)), "top_p", "top_p"),
        (lambda llm: llm.generate("hi", SamplingParams(top_p=1.5)), "top_p", "top_p"),
        (lambda llm: llm.generate([[10**9]], SamplingParams()), "out of range", "prompt"),
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(llm, make, field, param):
    with pytest.raises(ValueError, match=field) as info:  # a RequestError is a ValueError
        make(llm)
    assert isinstance(info.value, RequestError) and info.value.param == param
    llm.engine.check_integrity()
    assert not llm.engine.has_unfinished_requests()
    assert text(llm.generate("Hello", SamplingParams(max_tokens=2, temperature=0.0))[0])


def test_unknown_model_path():
    with pytest.raises(ValueError, match="does not exist"):
        LLM("/no/such/model.gguf")


def test_step_budget_is_the_cpu_default_when_unset(llm):
    # LLM() leaves max_num_batched_tokens unset: the engine fills in the CPU's default
    # (config.py DEFAULT_MAX_NUM_BATCHED_TOKENS, measured on the chat load of bench_peer.py).
    assert llm.engine.config.scheduler.max_num_batched_tokens == 1024
    assert llm.engine.scheduler.config.max_num_batched_tokens == 1024
    long = llm.generate(["word " * 1500], SamplingParams(max_tokens=2))[0]  # 2 chunks
    assert len(long.outputs[0].token_ids) == 2


def _fail_forward_once(llm, monkeypatch, after: int = 0):
    """The step's forward raises once, after ``after`` good steps (a kernel's error)."""
    run = llm.engine.forward.run
    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == after + 1:
            raise RuntimeError("boom in the forward")
        return run(*args, **kwargs)

    monkeypatch.setattr(llm.engine.forward, "run", failing)


@pytest.mark.parametrize("api", ["generate", "stream"])
def test_a_failed_step_raises_and_the_engine_serves_the_same_answer_after(llm, monkeypatch, api):
    """How an embedded request ends when a step fails: the exception reaches the caller (no
    output that passes for an answer), nothing is left running, and the same request then gets
    the same answer as before the fault."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = text(llm.generate(PROMPT, params)[0])
    _fail_forward_once(llm, monkeypatch, after=2)
    with pytest.raises(RuntimeError, match="boom in the forward"):
        if api == "generate":
            llm.generate([PROMPT, "Hello"], params)
        else:
            list(llm.stream(PROMPT, params))
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
    assert text(llm.generate(PROMPT, params)[0]) == want
