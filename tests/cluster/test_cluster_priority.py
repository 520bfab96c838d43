"""A real cluster under ``--scheduling-policy priority`` (router in this process, one prefill and
one decode worker process on the default model, each serving one sequence at a time): requests
that wait for the decode worker's only slot are served lower priority value first, whatever
order they came in; and the router refuses nothing a worker could not take."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.cluster.launcher import Cluster
from engine.cluster.router.router import RouterConfig
from engine.sampling_params import SamplingParams

WORKER_ARGS = ["--kv-cache-memory-gb", "0.25", "--kv-staging-mb", "128", "--dtype", "float32",
               "--max-num-seqs", "1", "--scheduling-policy", "priority"]  # fmt: skip
SHORT = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)


async def ended_at(router, prompt, rid, priority) -> float:
    async for out in router.generate(prompt, SHORT, request_id=rid, priority=priority):
        if out.finished:
            assert len(out.outputs[0].token_ids) == 4
    return time.monotonic()


@pytest.mark.slow
def test_waiting_requests_are_served_lower_priority_value_first():
    cfg = RouterConfig(scheduling_policy="priority", rejection="none")
    with Cluster(1, 1, worker_args=WORKER_ARGS, router_config=cfg) as cluster:
        router = cluster.router

        def decode_waiting() -> int:
            st = router.workers_status()
            return sum(v["waiting"] for v in st.values() if v["role"] == "decode")

        async def main() -> list[float]:
            hold = router.generate(list(range(100, 140)), LONG, request_id="hold")
            for _ in range(3):  # it decodes on the decode worker, in its only sequence slot
                await anext(hold)
            prompts = [list(range(1000 * i, 1000 * i + 30)) for i in (1, 2, 3)]
            tasks = [
                asyncio.ensure_future(ended_at(router, p, f"r{i}", prio))
                for i, (p, prio) in enumerate(zip(prompts, [3, -1, 0]))
            ]
            deadline = time.monotonic() + 120
            while decode_waiting() < 3:  # prefilled, and queued behind the slot (heartbeats)
                assert time.monotonic() < deadline, router.workers_status()
                assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]
                await asyncio.sleep(0.1)
            await hold.aclose()  # aborted: the slot frees
            return list(await asyncio.gather(*tasks))

        ends = asyncio.run(main())
    assert sorted(range(3), key=ends.__getitem__) == [1, 2, 0]  # priorities -1, 0, 3
