"""A stage of a pipelined prefill group killed mid-prefill (SIGKILL, real processes): the
request's group leg fails, the router aborts its other legs and places it again on the prefill
worker beside the group, and it completes with the answer it would have had; the group is down
(nothing is placed on it) until the stage rejoins, then serves again; nothing leaks on the
surviving stage or on the decode worker (blocks, hidden-state rows, KV staging, transfers)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from cluster_checks import collect

from engine.cluster.launcher import Cluster
from engine.cluster.placement import Placed, PlacementBase
from engine.cluster.router.router import RouterConfig
from engine.sampling_params import SamplingParams

ARGS = ["--dtype", "float32", "--kv-cache-memory-gb", "0.25", "--kv-staging-mb", "256",
        "--max-num-batched-tokens", "128"]  # fmt: skip
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ROUTER = RouterConfig(heartbeat_timeout_s=2.0)


class GroupFirst(PlacementBase):
    """The group while it is up, else the prefill worker alone (and the decode worker)."""

    def place(self, prompt_token_ids, prefill, decode, priority=0) -> Placed | None:
        units = sorted(prefill, key=lambda w: -w.stages)
        return Placed(units[0].worker_id, decode[0].worker_id) if units and decode else None


def idle(cluster: Cluster, timeout: float = 20.0) -> dict:
    """The live workers' heartbeats, once none holds anything."""
    fields = ("running", "waiting", "used_blocks", "staging_used", "transfers")
    deadline = time.monotonic() + timeout
    while True:
        st = {k: w for k, w in cluster.router.workers_status().items() if w["state"] == "up"}
        busy = {k: {f: w[f] for f in fields} for k, w in st.items() if any(w[f] for f in fields)}
        if not busy:
            return st
        assert time.monotonic() < deadline, f"still holding: {busy}"
        time.sleep(0.3)


@pytest.mark.slow  # CI time on a 2-core Zen 3 EPYC: `pytest -m slow`
def test_a_stage_killed_mid_prefill_is_retried_elsewhere_and_leaks_nothing():
    prompt = [100 + (i * 37) % 30000 for i in range(2000)]  # 16 chunks through the group
    with Cluster(1, 1, worker_args=ARGS, router_config=ROUTER, prefill_groups=1,
                 stages=2) as cluster:  # fmt: skip
        router = cluster.router
        router.set_placement(GroupFirst())

        async def baseline():
            return await collect(router, prompt[:200], GREEDY)  # warm; placed on the group

        asyncio.run(baseline())
        victim = cluster.procs["group-0-stage-1"]

        async def killed():
            task = asyncio.ensure_future(collect(router, prompt, GREEDY, rid="r"))
            deadline = time.monotonic() + 60
            while (router.placement_of("r") or ("",))[0] != "prefill":
                assert time.monotonic() < deadline, "never reached the prefill phase"
                await asyncio.sleep(0.02)
            assert router.placement_of("r")[1] == "group:group-0"
            await asyncio.sleep(1.0)  # chunks are flowing through both stages
            os.kill(victim.pid, signal.SIGKILL)
            return await task

        out, _ = asyncio.run(killed())
        assert victim.wait(10) == -signal.SIGKILL
        status = router.workers_status()
        assert status["group-0-stage-1"]["state"] == "dead"
        assert router.is_healthy()  # the prefill worker alone still serves
        # Placed again on the prefill worker: the answer a single worker gives.
        ref, _ = asyncio.run(collect(router, prompt, GREEDY))
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert len(out.outputs[0].token_ids) == 6
        idle(cluster)  # the surviving stage and the decode worker hold nothing

        # The group is down: only the prefill worker is placed on now.
        async def placed_on() -> str:
            task = asyncio.ensure_future(collect(router, prompt[:300], GREEDY, rid="q"))
            while router.placement_of("q") is None and not task.done():
                await asyncio.sleep(0.005)
            unit = router.placement_of("q")[1] if router.placement_of("q") else ""
            await task
            return unit

        assert asyncio.run(placed_on()) == "prefill-0"
        cluster.start_worker("prefill", "group-0-stage-1")  # rejoins: the group is up again
        cluster.router.wait_for_workers(1, 1, 120, check=cluster.check_children, groups=1)
        assert asyncio.run(placed_on()) == "group:group-0"
        again, _ = asyncio.run(collect(router, prompt, GREEDY))
        assert again.outputs[0].token_ids == ref.outputs[0].token_ids
        idle(cluster)
