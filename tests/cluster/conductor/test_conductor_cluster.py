"""The Conductor on a real cluster (slow: two prefill workers and one decode worker, SmolLM2):
with ``cache_aware`` a repeated prompt goes back to the prefill worker that holds its prefix and
that worker really reuses it (cached tokens reported by the worker); a prompt held nowhere may go
to either. An SLO refusal on the same cluster is a RequestRejectedError with its reason."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from engine.cluster.conductor.adapter import RequestRejectedError
from engine.cluster.launcher import Cluster
from engine.cluster.placement import PlacementBase
from engine.cluster.router.router import RouterConfig
from engine.kvcache.prefix_hash import hash_blocks
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
WORKER_ARGS = ["--kv-cache-memory-gb", "0.25", "--kv-staging-mb", "64", "--dtype", "float32"]
PROMPT = list(range(3000, 3000 + 100))  # 6 full blocks of 16


async def run(router, prompt, rid):
    return [o async for o in router.generate(prompt, GREEDY, request_id=rid)][-1]


def test_repeated_prompt_reuses_the_prefix_on_its_worker():
    cfg = RouterConfig(policy="cache_aware", rejection="none")
    with Cluster(2, 1, worker_args=WORKER_ARGS, router_config=cfg) as c:
        router = c.router
        first = asyncio.run(run(router, PROMPT, "a"))
        holder = router.placement.last_decision.prefill
        assert first.metrics.num_cached_tokens == 0
        chain = hash_blocks(PROMPT, 16)
        deadline = time.monotonic() + 30  # the worker's own events confirm what it holds
        while router.prefix_blocks(holder, chain) < len(chain):
            assert time.monotonic() < deadline, "the holder's events never came"
            time.sleep(0.1)
        for i in range(2):
            again = asyncio.run(run(router, PROMPT, f"b{i}"))
            assert router.placement.last_decision.prefill == holder
            assert again.metrics.num_cached_tokens == len(chain) * 16  # reused, not recomputed
            assert again.outputs[0].token_ids == first.outputs[0].token_ids
        # The same live cluster refuses when its TTFT SLO cannot be met.
        router.placement.conductor.config = replace(
            router.placement.conductor.config, ttft_slo_s=1e-6
        )
        with pytest.raises(RequestRejectedError, match="ttft_slo"):
            asyncio.run(run(router, PROMPT, "c"))


def test_pool_service_events_reach_the_conductor():
    """--pool-service: the workers write their blocks to the pool, whose published events tell
    the router's Conductor that the pool holds the prompt (a source kvcentric copies from)."""
    with Cluster(1, 1, worker_args=WORKER_ARGS, pool_service="dram=64MiB") as c:
        assert asyncio.run(run(c.router, PROMPT, "p")).finished
        index = c.router.placement.conductor.index
        pools = [h for h in index.holders() if h.startswith("pool@")]
        assert pools == [f"pool@{c.pool_address.removeprefix('tcp://')}"]
        chain = hash_blocks(PROMPT, 16)
        deadline = time.monotonic() + 30
        while index.match(pools[0], chain) < len(chain):
            assert time.monotonic() < deadline, "the pool's events never reached the Conductor"
            time.sleep(0.2)


class Scripted(PlacementBase):
    """Places request i on ``plan[i]`` = (prefill worker, copies as (src, dst, start, end))."""

    def __init__(self, plan) -> None:
        self.plan = list(plan)
        self.copies: list = []
        self.done: list[int] = []

    def place(self, prompt_token_ids, prefill, decode, priority=0):
        where, self.copies = self.plan.pop(0)
        return (where, decode[0].worker_id)

    def planned_copies(self):
        return self.copies

    def copy_done(self, router_id: str, blocks: int) -> None:
        self.done.append(blocks)


def test_blocks_copied_between_prefill_workers_are_served_from_the_targets_cache():
    """Hot-prefix replication on real workers: prefill-0 computes the prompt; the next request
    goes to prefill-1, which never saw it, with the prefix copied from prefill-0 first (block
    copies over the workers' own sockets): prefill-1 reports the prefix as cached and the greedy
    output is the one computed from scratch."""
    with Cluster(2, 1, worker_args=WORKER_ARGS) as c:
        router = c.router
        n = len(PROMPT) // 16
        placement = Scripted([("prefill-0", []), ("prefill-1", [("prefill-0", "prefill-1", 0, n)])])
        router.set_placement(placement)
        first = asyncio.run(run(router, PROMPT, "a"))
        assert first.metrics.num_cached_tokens == 0
        copied = asyncio.run(run(router, PROMPT, "b"))
        assert placement.done == [n]
        assert copied.metrics.num_cached_tokens == n * 16
        assert copied.outputs[0].token_ids == first.outputs[0].token_ids
