"""Structured outputs in the engine on the real default model: JSON-schema outputs finish "stop",
parse and validate at temperature 0 and seeded temperature 1; regex, choice, grammar and any JSON
object; reproducible greedy and seeded runs; n > 1 with a matcher per choice; logprobs from the
raw distribution; stop strings; a truncated output is "length"; the prefix cache, chunked prefill
and preemption leave constrained outputs valid and unchanged; an unconstrained neighbour is
unchanged by a constrained one, and a batch without constraints never builds a bitmask."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from engines import make_engine, run_all

import engine.core.sample_step as sample_step_module
from engine.bench.json_schemas import SCHEMAS
from engine.sampling_params import SamplingParams

MAX = 160  # enough for every schema above
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX)
UNCONSTRAINED = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def constrained(base: SamplingParams = GREEDY, **so) -> SamplingParams:
    fields = {f: getattr(base, f) for f in ("temperature", "top_p", "seed", "max_tokens", "n")}
    return SamplingParams(**{**fields, "structured_outputs": so})


def json_params(schema, temperature=0.0, seed=None, max_tokens=MAX, **kw) -> SamplingParams:
    so = {"json": schema}
    return SamplingParams(
        temperature=temperature, seed=seed, max_tokens=max_tokens, structured_outputs=so, **kw
    )


def check_json(out, schema):
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), schema)


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def engine():
    e = make_engine()
    yield e
    e.close()


@pytest.fixture(scope="module")
def prompt(engine):
    text = (
        "You are a librarian who answers every question with exactly one JSON object and "
        "nothing else. Question: tell me about a famous novel, its author and its year. Answer:"
    )
    ids = engine.tokenizer.encode(text)
    assert len(ids) > 32  # two full blocks: the prefix cache has something to hit
    return ids


def run_schemas(engine, prompt, **kw):
    params = [json_params(s, **kw) for s in SCHEMAS.values()]
    return run_all(engine, [prompt] * len(SCHEMAS), params)


@pytest.fixture(scope="module")
def greedy_json(engine, prompt):
    return run_schemas(engine, prompt)


def test_json_schemas_greedy_stop_parse_and_validate(greedy_json):
    for out, schema in zip(greedy_json, SCHEMAS.values(), strict=True):
        check_json(out.outputs[0], schema)


@pytest.mark.parametrize("seed", [1, 2])
def test_json_schemas_seeded_temperature_1(engine, prompt, seed):
    outs = run_schemas(engine, prompt, temperature=1.0, seed=seed)
    for out, schema in zip(outs, SCHEMAS.values(), strict=True):
        check_json(out.outputs[0], schema)
    # Seeded: the same again gives the same tokens.
    assert tokens(run_schemas(engine, prompt, temperature=1.0, seed=seed)) == tokens(outs)


def test_greedy_reproducible_and_cached_prefix_identical(engine, prompt, greedy_json):
    again = run_schemas(engine, prompt)
    assert tokens(again) == tokens(greedy_json)
    cached = [o.metrics.num_cached_tokens for o in again]
    assert all(c >= 32 for c in cached), cached  # the prompt's blocks came from the cache


def test_json_object_regex_choice_and_grammar(engine, prompt):
    seeded = SamplingParams(temperature=1.0, seed=4, max_tokens=MAX)
    cases = [
        ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
        ({"regex": r"[0-9]{3}-[a-z]{2,5}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", t)),
        (
            {"choice": ["fiction", "non-fiction", "poetry"]},
            lambda t: t in ("fiction", "non-fiction", "poetry"),
        ),  # noqa: E501
        (
            {"grammar": 'root ::= "year: " [0-9] [0-9] [0-9] [0-9]'},
            lambda t: re.fullmatch(r"year: \d{4}", t),
        ),  # noqa: E501
        ({"grammar": 'start: "ok" | "no"'}, lambda t: t in ("ok", "no")),
    ]
    for base in (GREEDY, seeded):
        outs = run_all(engine, [prompt] * len(cases), [constrained(base, **so) for so, _ in cases])
        for out, (so, ok) in zip(outs, cases, strict=True):
            c = out.outputs[0]
            assert c.finish_reason == "stop" and ok(c.text), (so, c.text)


def test_n3_each_choice_valid_with_its_own_matcher(engine, prompt):
    schema = SCHEMAS["nested"]
    params = json_params(schema, temperature=1.0, seed=11, n=3)
    rid = engine.add_request(prompt, params)
    reqs = engine.requests_of(rid)
    matchers = {id(r.grammar.matcher) for r in reqs}
    assert len(reqs) == 3 and len(matchers) == 3
    final = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                final = o
    assert len(final.outputs) == 3
    for c in final.outputs:
        check_json(c, schema)
    assert len({c.text for c in final.outputs}) > 1  # three samples, not one matcher's path


def test_logprobs_are_the_raw_distribution(engine, prompt):
    params = json_params(SCHEMAS["arrays-enums"], logprobs=5)
    (out,) = run_all(engine, [prompt], params)
    c = out.outputs[0]
    check_json(c, SCHEMAS["arrays-enums"])
    ids = c.token_ids
    raw = torch.log_softmax(engine.prompt_logits(prompt + ids), dim=-1)[len(prompt) - 1 : -1]
    masked_away = 0
    for i, (t, lp) in enumerate(zip(ids, c.logprobs, strict=True)):
        row = raw[i]
        assert lp.token_id == t
        assert lp.logprob == pytest.approx(float(row[t]), abs=1e-3)
        assert set(lp.top) == set(row.topk(5).indices.tolist())
        masked_away += int(row.argmax()) != t
    # The grammar overrode the model's favourite at some step: logprobs there still describe the
    # model (a constrained distribution would give the chosen token the highest logprob).
    assert masked_away > 0
    assert any(max(lp.top.values()) > lp.logprob + 1e-3 for lp in c.logprobs)
    # An unconstrained run has the same logprobs for the tokens they share.
    (free,) = run_all(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=4, logprobs=5))
    f = free.outputs[0]
    if f.token_ids[0] == ids[0]:
        assert f.logprobs[0].logprob == pytest.approx(c.logprobs[0].logprob, abs=1e-4)
    assert f.logprobs[0].top.keys() == c.logprobs[0].top.keys()


def test_stop_string_ends_a_constrained_output(engine, prompt, greedy_json):
    schema = SCHEMAS["nested"]
    full = greedy_json[1].outputs[0].text
    (out,) = run_all(engine, [prompt], json_params(schema, stop=[","]))
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == ","
    assert c.text == full[: full.index(",")]


def test_tiny_max_tokens_is_a_truncated_length(engine, prompt, greedy_json):
    schema = SCHEMAS["nested"]
    params = SamplingParams(temperature=0.0, max_tokens=5, structured_outputs={"json": schema})
    (out,) = run_all(engine, [prompt], params)
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 5
    assert c.token_ids == greedy_json[1].outputs[0].token_ids[:5]
    with pytest.raises(json.JSONDecodeError):
        json.loads(c.text)


def test_chunked_prefill_gives_the_same_outputs(prompt, greedy_json):
    chunked = make_engine(max_tokens=7)
    outs = run_schemas(chunked, prompt)
    assert tokens(outs) == tokens(greedy_json)
    chunked.close()


@pytest.mark.slow  # CI time on a 2-core Zen 3 EPYC: `pytest -m slow`
def test_preemption_keeps_outputs_valid_and_unchanged(prompt, greedy_json):
    most = max(len(o.outputs[0].token_ids) for o in greedy_json)  # each stops by itself
    blocks = -(-(len(prompt) + most) // 16) + 1  # one request fits, four at once do not
    small = make_engine(num_blocks=blocks, prefix=False)
    params = [json_params(s, max_tokens=most) for s in SCHEMAS.values()]
    outs = run_all(small, [prompt] * len(SCHEMAS), params)
    assert small.scheduler.num_preemptions > 0
    assert tokens(outs) == tokens(greedy_json)
    for out, schema in zip(outs, SCHEMAS.values(), strict=True):
        check_json(out.outputs[0], schema)
    assert small.kv.pool.check_integrity().used == 0
    small.close()


def test_unconstrained_neighbour_unchanged(engine, prompt):
    other = engine.tokenizer.encode("The three laws of thermodynamics are")
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True, logprobs=2)
    alone = run_all(engine, [other, other], [UNCONSTRAINED, seeded])
    mixed = run_all(
        engine,
        [other, prompt, other, prompt],
        [
            UNCONSTRAINED,
            json_params(SCHEMAS["nested"]),
            seeded,
            constrained(seeded, regex="[a-z]{9}"),
        ],
    )
    assert tokens([mixed[0], mixed[2]]) == tokens(alone)
    for a, m in zip(alone[1].outputs[0].logprobs, mixed[2].outputs[0].logprobs, strict=True):
        assert a.top == pytest.approx(m.top, abs=1e-5)
    check_json(mixed[1].outputs[0], SCHEMAS["nested"])


def test_a_batch_without_constraints_never_builds_a_bitmask(engine, prompt, monkeypatch):
    calls, batches = [], []
    real, sampler = sample_step_module.step_bitmask, engine.forward.sampler

    def spy(grammars, vocab_size):
        calls.append(len(grammars))
        return real(grammars, vocab_size)

    def sample(logits, batch):
        batches.append(batch)
        return sampler(logits, batch)

    monkeypatch.setattr(sample_step_module, "step_bitmask", spy)
    monkeypatch.setattr(engine.forward, "sampler", sample)
    seeded = SamplingParams(temperature=0.8, seed=1, max_tokens=8, ignore_eos=True)
    run_all(engine, [prompt, prompt], [UNCONSTRAINED, seeded])
    assert calls == [] and all(b.bitmask is None for b in batches)
    batches.clear()
    run_all(engine, [prompt, prompt], UNCONSTRAINED)
    assert batches and all(b.fast_greedy for b in batches)  # one argmax, as before
    run_all(engine, [prompt], constrained(GREEDY, choice=["a", "b"]))
    assert calls  # the spy sees constrained steps
    assert batches[-1].bitmask is not None and not batches[-1].fast_greedy
