"""The engine's public hand-off methods, which the cluster's prefill and decode roles use instead
of reaching into the engine: ``hand_over`` ends a prefill engine's choices after their first
token (counted as ``handed_over``, not as aborts, with every block freed) and
``add_prefilled`` continues them in another engine exactly as the colocated engine would
(greedy; seeded n > 1 with logprobs; a choice that stopped at its first token; structured-output
constraints, whose matchers the decode engine rebuilds from the first token; a first token the
grammar refuses ends the request, which then leaves the engine)."""

from __future__ import annotations

import pytest
from engines import make_engine, run_all

from engine.cluster.worker.handoff import capture
from engine.core.llm_engine import HANDED_OVER, FirstToken
from engine.sampling_params import SamplingParams

PROMPT = list(range(1000, 1000 + 40))
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, n=2, logprobs=2, max_tokens=5)


@pytest.fixture(scope="module")
def engines():
    return make_engine(), make_engine()


def first_tokens(engine, rid, params) -> list[FirstToken]:
    """Prefill rid in ``engine`` until every choice has its first token, then hand it over."""
    engine.add_request(PROMPT, params, request_id=rid)
    reqs = engine.requests_of(rid)
    assert len(reqs) == params.n
    while any(r.num_output_tokens == 0 for r in reqs):
        engine.step()
    firsts = []
    for i, req in enumerate(reqs):
        c = capture(i, req)
        firsts.append(
            FirstToken(
                req.output_token_ids[0],
                req.logprobs[0] if req.logprobs else None,
                c.first["sent_text_len"],
                c.generator_state,
            )
        )
    assert engine.hand_over(rid)
    while engine.has_unfinished_requests():  # the final output of the handed-over request
        engine.step()
    return firsts


def finish(engine, rid):
    last = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid:
                last = o
    return last


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded-n2-logprobs"])
def test_hand_over_then_add_prefilled_equals_colocated(engines, params):
    prefill, decode = engines
    want = run_all(make_engine(), [PROMPT], params)[0]
    before = dict(prefill.metrics.finished)
    rid = f"r-{params.n}"
    firsts = first_tokens(prefill, rid, params)
    # The prefill side: its choices ended as handed over, not aborted, and freed their blocks.
    after = prefill.metrics.finished
    assert after.get(HANDED_OVER, 0) - before.get(HANDED_OVER, 0) == params.n
    assert after.get("abort", 0) == before.get("abort", 0)
    assert prefill.requests_of(rid) == [] and prefill.kv.pool.counts().used == 0
    prefill.check_integrity()

    live = decode.add_prefilled(PROMPT, params, rid, firsts)
    assert sorted(live) == sorted(r.request_id for r in decode.requests_of(rid))
    got = finish(decode, rid)
    for g, w in zip(got.outputs, want.outputs, strict=True):
        assert g.token_ids == w.token_ids
        assert g.text == w.text
        assert g.finish_reason == w.finish_reason == "length"
        if params.logprobs is not None:
            assert [lp.token_id for lp in g.logprobs] == [lp.token_id for lp in w.logprobs]
            assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-4)
    decode.check_integrity()
    assert decode.kv.pool.counts().used == 0


def test_add_prefilled_checks_and_a_choice_that_stopped_at_its_first_token(engines):
    _, decode = engines
    with pytest.raises(ValueError, match="one token per choice"):
        decode.add_prefilled(PROMPT, SamplingParams(n=2), "bad", [FirstToken(5)])
    assert decode.requests_of("bad") == []

    # Choice 0's first token is a stop token: it ends there; choice 1 goes on.
    params = SamplingParams(temperature=0.0, n=2, max_tokens=4, stop_token_ids=(77,))
    live = decode.add_prefilled(PROMPT, params, "stop", [FirstToken(77), FirstToken(78)])
    assert live == ["stop#1"]
    out = finish(decode, "stop")
    assert out.outputs[0].token_ids == [77] and out.outputs[0].finish_reason == "stop"
    assert len(out.outputs[1].token_ids) == 4 and out.outputs[1].token_ids[0] == 78
    assert decode.hand_over("unknown") is False
    decode.check_integrity()


CONSTRAINED = [
    SamplingParams(
        temperature=1.0,
        seed=5,
        n=2,
        logprobs=2,
        max_tokens=60,
        structured_outputs={"json": {"type": "object", "properties": {"n": {"type": "integer"}}}},
    ),
    SamplingParams(temperature=0.0, max_tokens=20, structured_outputs={"regex": "[a-z]{4} [0-9]"}),
    SamplingParams(temperature=0.0, max_tokens=20, structured_outputs={"choice": ["one", "two"]}),
]


@pytest.mark.parametrize("params", CONSTRAINED, ids=["json-seeded-n2", "regex", "choice"])
def test_constrained_hand_over_equals_colocated(engines, params):
    # The decode engine has no KV connector: it recomputes the prompt, as a decode worker does
    # when a KV load fails. Its matcher is built fresh and fed the first token (add_prefilled's
    # append), and must allow exactly what the colocated engine's did.
    prefill, decode = engines
    want = run_all(make_engine(), [PROMPT], params)[0]
    rid = f"so-{params.structured_outputs.kind}"
    firsts = first_tokens(prefill, rid, params)
    decode.add_prefilled(PROMPT, params, rid, firsts)
    reqs = decode.requests_of(rid)
    assert (
        all(r.grammar is not None for r in reqs) and len({id(r.grammar) for r in reqs}) == params.n
    )
    got = finish(decode, rid)
    assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert [c.text for c in got.outputs] == [c.text for c in want.outputs]
    assert {c.finish_reason for c in got.outputs} == {"stop"}
    decode.check_integrity()


def test_a_first_token_the_grammar_refuses_fails_the_choice(engines):
    """It ends as a failure that says why ("error", "grammar_refused": a 503 in front of a
    client), not as "abort", which a stream passes on as a cancelled request."""
    _, decode = engines
    params = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs={"choice": ["a"]})
    bad = decode.tokenizer.encode("zebra")[0]
    assert decode.add_prefilled(PROMPT, params, "refused", [FirstToken(bad)]) == []
    out = finish(decode, "refused")
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == (
        "error",
        "grammar_refused",
    )
    assert decode.kv.pool.counts().used == 0
