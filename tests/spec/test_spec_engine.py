"""Speculative decoding in the engine, on the real default model in float32 (batch-invariant
C layers): with drafts, greedy and seeded outputs equal those without, token for token and
logprob for logprob, alone and batched; so do stop strings and stop tokens that fall inside a
kept run of drafts, max_tokens, n > 1, penalties, min_tokens, structured outputs, preemption
(few blocks), chunked prefill beside verifications (a small token budget) and the prefix cache
(a later prompt that extends an output hits the blocks that kept drafts filled, and answers as
a fresh engine does). Every step checks the cache's integrity; no block is held at the end."""

from __future__ import annotations

import json

import jsonschema
import pytest
from engines import make_engine, run_all

from engine.config import SpeculativeConfig
from engine.sampling_params import SamplingParams

CODE = '''def moving_average(values, window):
    """Return the moving averages of values over a window."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out
'''
ASKS = [
    "Rename the function below to rolling_mean and change nothing else. Answer with the whole "
    "code only.\n\n" + CODE,
    "Copy this text exactly: The Mooncake architecture separates prefill and decode clusters, "
    "and it keeps the KVCache in a distributed pool of DRAM and SSD across the GPU cluster.",
    "Write a haiku about the sea.",
    'Repeat this JSON with "age" set to 31: {"name": "Ada", "age": 30, "city": "London", '
    '"tags": ["math", "engines", "poetry"]}',
]
MAX = 48


@pytest.fixture(scope="module")
def base():
    e = make_engine()
    yield e
    e.close()


@pytest.fixture(scope="module", params=["ngram", "suffix"])
def spec(request):
    e = make_engine(speculative=SpeculativeConfig(method=request.param))
    yield e
    e.close()


@pytest.fixture(scope="module")
def prompts(base):
    return [base.tokenizer.apply_chat_template([{"role": "user", "content": a}]) for a in ASKS]


def same(a, b):
    """Equal choices: tokens, text, finish and stop reasons, logprobs (bit for bit)."""
    assert len(a.outputs) == len(b.outputs)
    for x, y in zip(a.outputs, b.outputs, strict=True):
        assert x.token_ids == y.token_ids
        assert x.text == y.text
        assert (x.finish_reason, x.stop_reason) == (y.finish_reason, y.stop_reason)
        if x.logprobs is not None:
            assert [(lp.token_id, lp.logprob, lp.top) for lp in x.logprobs] == [
                (lp.token_id, lp.logprob, lp.top) for lp in y.logprobs
            ]


def no_blocks_held(engine):
    assert not engine.kv.block_tables
    assert engine.kv.pool.num_free == engine.kv.num_blocks


def test_greedy_equals_decoding_without_drafts_batched_and_alone(base, spec, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=MAX, logprobs=3)
    before = spec.spec.stats.snapshot()
    want = run_all(base, prompts, params)
    for a, b in zip(want, run_all(spec, prompts, params), strict=True):
        same(a, b)
    for p, a in zip(prompts, want, strict=True):
        same(a, run_all(spec, [p], params)[0])
    after = spec.spec.stats.snapshot()
    assert after["accepted"] - before["accepted"] >= MAX  # drafts were kept, many of them
    assert after["proposed"] > after["accepted"]  # and some were not
    no_blocks_held(spec)


def test_seeded_sampling_with_penalties_equals_decoding_without_drafts(base, spec, prompts):
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=MAX, logprobs=2),
        SamplingParams(temperature=0.7, top_k=20, seed=4, max_tokens=MAX, frequency_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=MAX, repetition_penalty=1.2, min_tokens=40),
        SamplingParams(temperature=1.0, seed=5, max_tokens=MAX, presence_penalty=0.4, n=3),
    ]
    for a, b in zip(run_all(base, prompts, params), run_all(spec, prompts, params), strict=True):
        same(a, b)
    no_blocks_held(spec)


def test_stops_inside_a_kept_run_end_where_they_end_without_drafts(base, spec, prompts):
    copy = prompts[1]
    full = run_all(base, [copy], SamplingParams(temperature=0.0, max_tokens=MAX))[0].outputs[0]
    ids, text = full.token_ids, full.text
    cases = [
        SamplingParams(temperature=0.0, max_tokens=MAX, stop=[text[30:38]]),
        SamplingParams(
            temperature=0.0, max_tokens=MAX, stop=[text[30:38]], include_stop_str_in_output=True
        ),
        SamplingParams(temperature=0.0, max_tokens=MAX, stop_token_ids=[ids[13]]),
        SamplingParams(temperature=0.0, max_tokens=11),
        SamplingParams(temperature=0.0, max_tokens=MAX, min_tokens=20, stop_token_ids=[ids[13]]),
    ]
    for params in cases:
        want = run_all(base, [copy], params)[0]
        got = run_all(spec, [copy], params)[0]
        same(want, got)
        assert len(got.outputs[0].token_ids) < MAX
    no_blocks_held(spec)


def test_structured_output_equals_and_validates(base, spec, prompts):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    params = SamplingParams(temperature=0.0, max_tokens=64, structured_outputs={"json": schema})
    a = run_all(base, [prompts[3]], params)[0]
    b = run_all(spec, [prompts[3]], params)[0]
    same(a, b)
    jsonschema.validate(json.loads(b.outputs[0].text), schema)


@pytest.mark.parametrize("case", ["preemption", "chunked_prefill"])
def test_preemption_and_chunked_prefill_beside_verifications(base, prompts, case):
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    want = run_all(base, prompts * 2, params)
    if case == "preemption":  # one request always fits, eight at once do not
        longest = max(len(base.tokenizer.encode(p)) for p in prompts) + params.max_tokens
        kw = dict(num_blocks=-(-longest // 16) + 1, prefix=False)
    else:  # a 24-token budget splits prompts beside running verifications
        kw = dict(max_tokens=24)
    small = make_engine(**kw, speculative=SpeculativeConfig(method="ngram"))
    try:
        got = run_all(small, prompts * 2, params)
        if case == "preemption":
            assert small.scheduler.num_preemptions > 0
        assert small.spec.stats.accepted > 0
        for a, b in zip(want, got, strict=True):
            same(a, b)
        no_blocks_held(small)
    finally:
        small.close()


def test_blocks_that_kept_drafts_filled_serve_the_prefix_cache(spec, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=MAX, ignore_eos=True)
    first = run_all(spec, [prompts[0]], params)[0]
    longer = spec.tokenizer.encode(prompts[0]) + first.outputs[0].token_ids
    fresh = make_engine(prefix=False)
    try:
        want = run_all(fresh, [longer], params)[0]
    finally:
        fresh.close()
    hits = spec.kv.prefix_hits
    got = run_all(spec, [longer], params)[0]
    # The hit covers blocks filled by the first request's decode, drafts kept among them.
    assert spec.kv.prefix_hits - hits >= (len(longer) // 16 - 1) * 16
    same(want, got)
