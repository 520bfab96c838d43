"""Structured outputs across a real cluster (router in this process, one prefill and one decode
worker process): the constraint travels in the request's parameters, the prefill worker samples
each choice's first token under the grammar, the decode worker compiles the same constraint,
feeds its matchers those first tokens and goes on. Seeded and greedy constrained requests give
the colocated engine's outputs exactly, alone and batched."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
from cluster_checks import collect, wait_idle
from engines import make_engine

from engine.cluster.launcher import Cluster
from engine.cluster.router.router import RouterConfig
from engine.sampling_params import SamplingParams

WORKER_ARGS = ["--kv-cache-memory-gb", "0.25", "--max-num-batched-tokens", "64",
               "--kv-staging-mb", "128", "--dtype", "float32"]  # fmt: skip
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "rank": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["old", "big"]}, "maxItems": 2},
    },
    "required": ["city", "rank"],
}
REQUESTS = [
    SamplingParams(
        temperature=1.0,
        seed=21,
        n=2,
        logprobs=2,
        max_tokens=60,
        structured_outputs={"json": SCHEMA},
    ),
    SamplingParams(temperature=0.0, max_tokens=60, structured_outputs={"json": SCHEMA}),
    SamplingParams(
        temperature=0.8, seed=3, max_tokens=20, structured_outputs={"regex": "[A-Z][a-z]{3,6}"}
    ),  # noqa: E501
    SamplingParams(
        temperature=1.0,
        seed=8,
        max_tokens=8,
        structured_outputs={"choice": ["north", "south", "east"]},
    ),  # noqa: E501
]
CHECKS = [
    lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None,
    lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None,
    lambda t: re.fullmatch(r"[A-Z][a-z]{3,6}", t) is not None,
    lambda t: t in ("north", "south", "east"),
]


def prompt(tok):
    # 70 tokens: the prefill worker runs it in two chunks (64 + 6).
    text = "Name a European city and describe it as JSON. " * 7
    ids = tok.encode(text)
    assert len(ids) > 64
    return ids


def summary(out):
    return [(c.token_ids, c.text, c.finish_reason) for c in out.outputs]


@pytest.fixture(scope="module")
def reference():
    engine = make_engine(max_tokens=64)
    ids = prompt(engine.tokenizer)
    outs = []
    for params in REQUESTS:
        rid = engine.add_request(ids, params)
        final = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id == rid and o.finished:
                    final = o
        outs.append(final)
    engine.close()
    return ids, outs


@pytest.fixture(scope="module")
def cluster():
    with Cluster(1, 1, worker_args=WORKER_ARGS, router_config=RouterConfig()) as c:
        yield c


def test_constrained_outputs_equal_colocated_alone_and_batched(cluster, reference):
    ids, want = reference
    for w, check in zip(want, CHECKS, strict=True):
        for c in w.outputs:
            assert c.finish_reason == "stop" and check(c.text), c.text

    async def main():
        alone = [(await collect(cluster.router, ids, p))[0] for p in REQUESTS]
        batched = await asyncio.gather(*(collect(cluster.router, ids, p) for p in REQUESTS))
        return alone, [b[0] for b in batched]

    alone, batched = asyncio.run(main())
    assert [summary(o) for o in alone] == [summary(o) for o in want]
    assert [summary(o) for o in batched] == [summary(o) for o in want]
    for got, w in zip(alone[0].outputs, want[0].outputs, strict=True):
        assert [lp.token_id for lp in got.logprobs] == [lp.token_id for lp in w.logprobs]
    wait_idle(cluster)


def test_a_constraint_that_does_not_compile_is_refused(cluster, reference):
    ids, _ = reference
    bad = SamplingParams(max_tokens=4, structured_outputs={"regex": "(unclosed"})

    async def main():
        return await collect(cluster.router, ids, bad)

    with pytest.raises(Exception, match="structured_outputs.regex could not be compiled"):
        asyncio.run(main())
    wait_idle(cluster)
