"""Worker health and the pool service with real processes (slow): one prefill and two decode
workers sharing one pool service (``--pool-service``).

- Both roles save to the pool service: the prefill worker the prompt's blocks, the decode
  worker the blocks it completes while decoding.
- A decode worker sent SIGTERM while it decodes shows as draining in /metrics and /health (and
  finishes its request); the other, SIGKILLed, shows as dead once the heartbeat deadline passed.
"""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest
from cluster_checks import key, samples
from engines import make_engine
from server.serverutil import http_server

from engine.cluster.launcher import Cluster
from engine.cluster.router.router import RouterConfig
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

WORKER_ARGS = ["--kv-cache-memory-gb", "0.25", "--max-num-batched-tokens", "64",
               "--kv-staging-mb", "64", "--dtype", "float32"]  # fmt: skip


def wait_until(cond, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def pool_blocks(address: str, ns) -> int:
    from engine.kvstore.service_tier import PoolClientTier

    client = PoolClientTier(address, ns)
    try:
        return client.stats()["blocks"]
    finally:
        client.close()


def test_pool_service_for_both_roles_then_draining_and_dead_in_metrics():
    from engine.kvstore.namespace import make_namespace

    e = make_engine()  # the workers' model, dtype and block size: the pool's namespace
    ns = make_namespace(e.model_config, e.model, e.cache.kv.dtype, e.kv.block_size)
    cfg = RouterConfig(heartbeat_timeout_s=2.0)
    with Cluster(1, 2, worker_args=WORKER_ARGS, router_config=cfg,
                 pool_service="dram=64MiB") as cluster:  # fmt: skip
        router = cluster.router
        prompt = list(range(1000, 1040))  # blocks 0-1 full after prefill; 2-3 while decoding
        params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)

        async def one():
            return [o async for o in router.generate(prompt, params, request_id="a")][-1]

        assert len(asyncio.run(one()).outputs[0].token_ids) == 30
        wait_until(lambda: pool_blocks(cluster.pool_address, ns) == 4, "4 blocks in the pool")

        long = SamplingParams(temperature=0.0, max_tokens=600, ignore_eos=True)
        with http_server(router) as srv:

            def metric(name, **labels):
                text = httpx.get(f"{srv.url}/metrics", timeout=30).text
                return samples(text).get(key(name, **labels))

            async def drain_and_kill():
                task = asyncio.ensure_future(
                    _last(router.generate(list(range(2000, 2050)), long, request_id="b"))
                )
                await asyncio.to_thread(
                    wait_until, lambda: (router.placement_of("b") or ("",))[0] == "decode", "decode"
                )
                busy = router.placement_of("b")[2]
                other = "decode-1" if busy == "decode-0" else "decode-0"
                cluster.procs[busy].send_signal(signal.SIGTERM)
                cluster.procs[other].send_signal(signal.SIGKILL)
                draining = dict(worker=busy, role="decode", state="draining")
                dead = dict(worker=other, role="decode", state="dead")
                await asyncio.to_thread(
                    wait_until,
                    lambda: metric("engine:worker_state", **draining) == 1,
                    "the SIGTERMed worker shown draining",
                )
                health = httpx.get(f"{srv.url}/health", timeout=30).json()
                assert health["workers"][busy]["state"] == "draining"
                await asyncio.to_thread(
                    wait_until,
                    lambda: metric("engine:worker_state", **dead) == 1,
                    "the SIGKILLed worker shown dead",
                )
                assert metric("engine:worker_up", worker=other, role="decode") == 0
                out = await asyncio.wait_for(task, 300)  # the draining worker finishes it
                return busy, out

            busy, out = asyncio.run(drain_and_kill())
            assert len(out.outputs[0].token_ids) == 600
            assert cluster.procs[busy].wait(60) == 0  # drained, then left
            wait_until(lambda: router.workers_status()[busy]["state"] == "left", "left")
            assert metric("engine:worker_state", worker=busy, role="decode", state="left") == 1


async def _last(stream):
    last = None
    async for o in stream:
        last = o
    return last
