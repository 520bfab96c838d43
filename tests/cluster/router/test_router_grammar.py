"""The router compiles a request's structured-output constraint with its own compiler (the
model's tokenizer, no weights) before any worker sees it: a bad one is refused there, naming
the field, even with no worker up."""

from __future__ import annotations

import asyncio

import pytest

from engine.cluster.router.router import Router, RouterConfig
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def router():
    r = Router(RouterConfig())
    yield r
    r.close()


def test_no_constraint_loads_no_compiler(router):
    asyncio.run(router.compile_grammar(SamplingParams()))
    assert router._grammar_compiler is None


def test_a_constraint_compiles_once(router):
    params = SamplingParams(structured_outputs={"json": {"type": "object"}})
    asyncio.run(router.compile_grammar(params))
    asyncio.run(router.compile_grammar(params))
    compiler = router._grammar_compiler
    assert compiler is not None and compiler.compiles == 1 and compiler.hits == 1


def test_a_bad_constraint_is_refused_before_a_worker_sees_it(router):
    params = SamplingParams(structured_outputs={"regex": "(unclosed"})
    with pytest.raises(ValueError, match="structured_outputs.regex could not be compiled"):
        asyncio.run(router.compile_grammar(params))
