"""Continuous batching on the real default model: chunked prefill, prefix caching, preemption,
abort, and the asyncio front. Outputs are compared token for token with unconstrained runs."""

from __future__ import annotations

import asyncio

import pytest
from engines import GREEDY, make_engine, run_all

from engine.async_llm import AsyncLLM
from engine.sampling_params import SamplingParams


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts():
    base = make_engine(num_blocks=8)
    tok = base.tokenizer
    texts = [
        "The three laws of thermodynamics are",
        "A recipe for pancakes: first, take",
        "In 1969, the first humans to walk on the Moon",
        "Python list comprehensions let you",
    ]
    return [tok.encode(t * 3) for t in texts]


@pytest.fixture(scope="module")
def reference(prompts):
    return tokens(run_all(make_engine(), prompts))


@pytest.mark.parametrize("budget", [5, 16, 37])
def test_chunked_prefill_any_chunk_size_same_tokens(prompts, reference, budget):
    engine = make_engine(max_tokens=budget)
    assert tokens(run_all(engine, prompts)) == reference


def test_shared_prefix_computes_only_the_tail(prompts):
    engine = make_engine()
    system = engine.tokenizer.encode("You are a careful assistant. " * 12)  # > 4 full blocks
    a, b = system + prompts[0], system + prompts[1]
    (first,) = run_all(engine, [a])
    assert first.metrics.num_cached_tokens == 0
    (second,) = run_all(engine, [b])
    cached = second.metrics.num_cached_tokens
    assert cached == (len(system) // 16) * 16 and cached > 0
    assert second.metrics.num_computed_prompt_tokens == len(b) - cached
    # Identical output to an engine with no prefix cache.
    (cold,) = run_all(make_engine(prefix=False), [b])
    assert second.outputs[0].token_ids == cold.outputs[0].token_ids
    snap = engine.metrics_snapshot()
    assert snap.prefix_hits == cached and snap.prefix_queries >= len(a) + len(b)


def test_preemption_under_tiny_kv_budget_gives_identical_output(prompts):
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    longest = max(len(p) for p in prompts) + params.max_tokens
    num_blocks = -(-longest // 16) + 1  # one request always fits; four at once do not
    engine = make_engine(num_blocks=num_blocks, prefix=False)
    outs = run_all(engine, prompts, params)
    assert tokens(outs) == tokens(run_all(make_engine(), prompts, params))
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.pool.check_integrity().used == 0


def test_abort_frees_every_block(prompts):
    engine = make_engine()
    rids = [engine.add_request(p, SamplingParams(max_tokens=50)) for p in prompts]
    engine.step()
    engine.step()
    assert engine.kv.pool.counts().used > 0
    for rid in rids:
        assert engine.abort_request(rid)
    assert engine.kv.pool.check_integrity().used == 0
    outs = engine.step()
    assert {o.request_id for o in outs} == set(rids)
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    assert not engine.abort_request(rids[0])  # abort of a finished request is a no-op
    assert not engine.has_unfinished_requests()


def test_async_front_serves_concurrent_callers_and_aborts_on_close(prompts, reference):
    llm = AsyncLLM(make_engine())

    async def collect(p):
        last = None
        async for out in llm.generate(p, GREEDY):
            last = out
        return last.outputs[0].token_ids

    async def leave_early(p):
        agen = llm.generate(p, SamplingParams(max_tokens=200, ignore_eos=True))
        async for _ in agen:
            break
        await agen.aclose()

    async def main():
        got = await asyncio.gather(*(collect(p) for p in prompts * 3))
        await asyncio.gather(*(leave_early(p) for p in prompts))
        for _ in range(100):  # the loop thread applies the aborts between steps
            if llm.num_in_flight == 0 and llm.metrics().kv_usage == 0.0:
                break
            await asyncio.sleep(0.05)
        return got

    try:
        got = asyncio.run(main())
        assert got == reference * 3
        assert llm.num_in_flight == 0
        snap = llm.metrics()
        assert snap.num_running == 0 and snap.kv_usage == 0.0
        assert snap.finished.get("abort") == len(prompts)
        llm.engine.check_integrity()
    finally:
        llm.close()


def test_a_step_says_whether_it_only_decoded(prompts):
    """LLMEngine.last_step_decode_only: what a decode worker's heartbeats may time as decode
    steps for the Conductor's TBT model (a recompute's prefill chunks are not: a chaos run
    taught the model 2.4 s steps from them, and the router refused every request)."""
    engine = make_engine(max_tokens=16)
    engine.add_request(prompts[0], GREEDY, request_id="a")
    chunks = -(-len(prompts[0]) // 16)  # the prompt in chunks of 16, the last one samples
    seen = []
    for _ in range(chunks + 2):
        engine.step()
        seen.append(engine.last_step_decode_only)
    assert seen == [False] * chunks + [True, True]
    engine.add_request(prompts[1], GREEDY, request_id="b")  # a prefill chunk beside a's decode
    engine.step()
    assert not engine.last_step_decode_only
