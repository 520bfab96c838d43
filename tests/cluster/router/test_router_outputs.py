"""The router hands its callers the outputs the engine would: a decode worker's engine outputs,
sent as ``Outputs`` entries (worker/handoff.py) and assembled by the router (router/outputs.py,
on the core's output builder), equal the engine's own, step by step: text, tokens, logprobs,
deltas and finish reasons."""

from __future__ import annotations

from engines import make_engine

from engine.cluster.router.outputs import apply_outputs, assemble
from engine.cluster.router.request import Choice, RouterRequest
from engine.core.metrics import EngineMetrics
from engine.ipc.wire import output_to_wire
from engine.outputs import RequestMetrics
from engine.sampling_params import SamplingParams


def _fields(c):
    lps = None if c.logprobs is None else [(lp.token_id, lp.logprob) for lp in c.logprobs]
    new = None if c.new_logprobs is None else [lp.token_id for lp in c.new_logprobs]
    return (c.index, c.text, c.token_ids, c.new_text, c.new_token_ids, lps, new,
            c.cumulative_logprob, c.finish_reason, c.stop_reason)  # fmt: skip


def test_the_router_assembles_the_engines_outputs_exactly():
    engine = make_engine()
    params = SamplingParams(
        temperature=0.8, seed=3, n=2, min_tokens=3, max_tokens=12, logprobs=2, stop=[" the"]
    )
    prompt = engine.tokenizer.encode("Once upon a time, in a land far away,")
    rid = engine.add_request(prompt, params)
    req = RouterRequest(rid, prompt, None, params, None, None, 0.0,
                        [Choice(logprobs=[]) for _ in range(params.n)],
                        RequestMetrics(arrival_time=0.0))  # fmt: skip
    stats = EngineMetrics()
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            apply_outputs(req, [output_to_wire(c, offsets=True) for c in out.outputs])
            got = assemble(req, stats, now=float(steps))
            assert [_fields(c) for c in got.outputs] == [_fields(c) for c in out.outputs]
            assert (got.request_id, got.prompt_token_ids, got.finished) == (
                out.request_id,
                out.prompt_token_ids,
                out.finished,
            )
            steps += 1
    assert steps > 2 and req.finished
    assert stats.generation_tokens == sum(len(c.output_token_ids) for c in req.choices)
    assert sum(stats.finished.values()) == params.n
