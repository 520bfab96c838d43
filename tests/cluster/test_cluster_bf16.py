"""The default dtype on this CPU (bfloat16) through a real cluster: the decode worker runs its
decode steps in the C decoder layers (layers/native_decode.py) on KV that arrived from the prefill
worker, and the greedy output equals the colocated engine's, which runs the same layers."""

from __future__ import annotations

import asyncio

import pytest
from engines import run_all

from engine.cluster.launcher import Cluster
from engine.cluster.router.router import RouterConfig
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [list(range(1000, 1150)), list(range(2000, 2040)), list(range(3000, 3017))]
WORKER_ARGS = ["--kv-cache-memory-gb", "0.25", "--max-num-batched-tokens", "64",
               "--kv-staging-mb", "128", "--dtype", "bfloat16"]  # fmt: skip


@pytest.mark.slow  # CI time on a 2-core Zen 3 EPYC: `pytest -m slow`
def test_bf16_cluster_equals_colocated_one_request_at_a_time():
    engine = LLMEngine(
        EngineConfig(
            model="default",
            dtype="bfloat16",
            device="cpu",
            cache=CacheConfig(num_blocks=256),
            scheduler=SchedulerConfig(max_num_batched_tokens=64),
        )
    )
    # One request at a time on both sides: the same steps (prefill chunks of 64, then decode
    # steps of one sequence), so the same kernels and bits.
    want = [run_all(engine, [p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]

    async def one(router, prompt):
        last = None
        async for out in router.generate(prompt, GREEDY):
            last = out
        return last.outputs[0].token_ids

    with Cluster(1, 1, worker_args=WORKER_ARGS, router_config=RouterConfig()) as cluster:
        got = [asyncio.run(one(cluster.router, p)) for p in PROMPTS]
    assert got == want
