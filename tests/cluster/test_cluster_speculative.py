"""Speculative decoding on a real 1 prefill + 1 decode cluster (``--speculative ngram`` passed to
its workers): the decode worker verifies drafts of requests whose prompt KV came from the
prefill worker, and every answer equals the colocated engine's without drafts, bit for bit
(tokens and logprobs), greedy and seeded; the router's /metrics adds up the workers' draft
counters; nothing is held afterwards."""

from __future__ import annotations

import asyncio
import time

import pytest
from cluster_checks import collect, wait_idle

from engine import LLM
from engine.cluster.launcher import Cluster
from engine.cluster.router.router import RouterConfig
from engine.kernels import native
from engine.sampling_params import SamplingParams

KV_GB = 0.25
PROMPTS = [
    "Repeat after me: one two three four, one two three four, one two three four",
    'Copy this JSON: {"name": "Ada", "age": 30, "tags": ["math", "engines"]} and again: ',
    "The list: apple, banana, cherry, apple, banana, cherry, apple, banana,",
]


def params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0.9, seed=5 + i, logprobs=1, max_tokens=24)
    return SamplingParams(temperature=0.0, logprobs=1, max_tokens=24, ignore_eos=True)


def signature(out):
    return [(c.token_ids, [lp.logprob for lp in c.logprobs]) for c in out.outputs]


@pytest.mark.skipif(native.compiler() is None, reason="no C compiler: the torch layers serve")
def test_decode_worker_verifies_drafts_and_answers_as_without_them():
    with LLM(device="cpu", kv_cache_memory_gb=KV_GB) as llm:
        if not llm.engine.model.deterministic:
            pytest.skip("the C layers do not apply on this CPU (no vector row dots)")
        want = [signature(llm.generate([p], params(i))[0]) for i, p in enumerate(PROMPTS)]
    args = ["--kv-cache-memory-gb", str(KV_GB), "--speculative", "ngram"]
    with Cluster(1, 1, worker_args=args, router_config=RouterConfig(rejection="none")) as c:

        async def main():
            return await asyncio.gather(
                *(collect(c.router, p, params(i)) for i, p in enumerate(PROMPTS))
            )

        outs = asyncio.run(main())
        for i, ((out, _), w) in enumerate(zip(outs, want, strict=True)):
            assert signature(out) == w, f"prompt {i}"
        wait_idle(c)
        deadline = time.monotonic() + 30  # the decode worker's counters come by heartbeat
        while not c.router.metrics().spec.get("accepted"):
            assert time.monotonic() < deadline, "no draft was kept on the decode worker"
            time.sleep(0.2)
