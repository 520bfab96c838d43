"""The router under ``--scheduling-policy priority``, against scripted workers (no model): a
request's priority reaches its Conductor decision and both workers' messages; under overload the
Conductor refuses lower priorities while it still admits higher ones; under fcfs a priority
other than 0 is a 400 naming the field, embedded, over HTTP and over RPC."""

from __future__ import annotations

import argparse
import asyncio
import contextlib

import httpx
import pytest
from server.serverutil import RPCThread, http_server
from test_router_conductor import ONE, ScriptedWorkers

from engine.cluster import messages as m
from engine.cluster.conductor.adapter import RequestRejectedError, make_placement
from engine.cluster.conductor.decision import REJECT_TTFT
from engine.cluster.router.router import Router, RouterConfig
from engine.errors import RequestError


class Recording(ScriptedWorkers):
    """Scripted workers that note the priority of every request sent to them and, with
    ``hold``, never answer a prefill (so the Conductor's queue only grows)."""

    def __init__(self, *args, hold: bool = False, **kwargs) -> None:
        self.sent: list[tuple[str, str, int]] = []  # (message type, request id, priority)
        self.hold = hold
        super().__init__(*args, **kwargs)

    def _answer(self, wid, s, msg) -> None:
        if isinstance(msg, m.DecodeRequest | m.PrefillRequest):
            self.sent.append((msg.TYPE, msg.request_id, msg.priority))
        if self.hold and isinstance(msg, m.PrefillRequest):
            return
        super()._answer(wid, s, msg)


@pytest.fixture
def started():
    with contextlib.ExitStack() as stack:  # closes the workers, then their router

        def start(hold=False, frozen_clock=False, **cfg):
            cfg = RouterConfig(heartbeat_timeout_s=60.0, **cfg)
            placement = make_placement(cfg)
            if frozen_clock:  # queued prefills never drain by the clock: estimates hold still
                placement.clock = lambda: 1000.0
            router = Router(cfg, placement)
            stack.callback(router.close)
            workers = Recording(router, ["p0"], ["d0"], hold=hold)
            stack.callback(workers.close)
            return router, workers

        yield start


def prompt(i: int) -> list[int]:
    return list(range(1000 + 300 * i, 1000 + 300 * i + 200))  # distinct: no prefix hits


async def last(router, ids, rid, priority=0):
    return [o async for o in router.generate(ids, ONE, request_id=rid, priority=priority)][-1]


def test_the_priority_reaches_both_workers(started):
    router, workers = started(scheduling_policy="priority")
    out = asyncio.run(last(router, prompt(0), "a", priority=-3))
    assert out.finished and out.outputs[0].token_ids == [7]
    assert sorted(workers.sent) == [("decode_request", "a/0", -3), ("prefill_request", "a/0", -3)]
    asyncio.run(last(router, prompt(1), "b"))
    assert ("prefill_request", "b/0", 0) in workers.sent


def test_under_overload_lower_priorities_are_refused_first(started):
    """The prefill worker never answers: every request placed waits in the Conductor's model of
    its queue. With a TTFT SLO of 3.5 prefills, three priority-5 requests are admitted and the
    fourth refused (429, ttft_slo); two priority-0 requests are admitted after that (each waits
    only for the head and the priority-0 ones before it: 2 and 3 prefills), priority-5 ones are
    still refused, a third priority-0 one too (4 prefills), and a priority -1 one admitted."""
    one = make_placement(RouterConfig()).conductor.prefill_model.predict(200, 0)
    router, workers = started(
        scheduling_policy="priority", rejection="none", ttft_slo_s=3.5 * one, hold=True,
        frozen_clock=True,
    )  # fmt: skip

    async def main():
        tasks, verdicts = [], []
        for i, prio in enumerate([5, 5, 5, 5, 0, 0, 5, 0, -1]):
            rid = f"r{i}"
            task = asyncio.ensure_future(last(router, prompt(i), rid, priority=prio))
            tasks.append(task)
            while not task.done() and (router.placement_of(rid) or ("",))[0] != "prefill":
                await asyncio.sleep(0.005)
            if task.done():
                with pytest.raises(RequestRejectedError) as info:
                    task.result()
                assert info.value.reason == REJECT_TTFT
                verdicts.append((prio, "refused"))
            else:
                verdicts.append((prio, "admitted"))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return verdicts

    assert asyncio.run(main()) == [
        (5, "admitted"), (5, "admitted"), (5, "admitted"), (5, "refused"),
        (0, "admitted"), (0, "admitted"), (5, "refused"), (0, "refused"), (-1, "admitted"),
    ]  # fmt: skip
    placed = [rid for kind, rid, _ in workers.sent if kind == "prefill_request"]
    assert placed == ["r0/0", "r1/0", "r2/0", "r4/0", "r5/0", "r8/0"]


def test_an_fcfs_router_refuses_a_priority_naming_the_field(started):
    router, workers = started()  # fcfs, the default
    with pytest.raises(RequestError) as info:
        asyncio.run(last(router, prompt(0), "x", priority=1))
    assert info.value.param == "priority" and "--scheduling-policy priority" in info.value.message
    assert workers.sent == []  # refused before anything was placed
    assert asyncio.run(last(router, prompt(0), "y", priority=0)).finished

    with http_server(router) as srv:
        body = {"model": "default", "prompt": prompt(1), "max_tokens": 1, "priority": 4}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text

    from engine.client import RPCClient, RPCError

    with RPCThread(router) as rpc, RPCClient(rpc.address, timeout=30) as client:
        with pytest.raises(RPCError) as err:
            client.generate(prompt(2), max_tokens=1, priority=-1)
    assert err.value.code == 400 and err.value.param == "priority"


def test_the_flag_reaches_the_router_the_conductor_and_the_workers():
    from engine.cli.cluster import _router_config, add_cluster_commands, worker_argv
    from engine.cli.engine_options import add_engine_options

    parser = argparse.ArgumentParser()
    add_cluster_commands(parser.add_subparsers(dest="command"), add_engine_options)
    for command in ("cluster", "router"):
        args = parser.parse_args([command, "--scheduling-policy", "priority"])
        cfg = _router_config(args, "tcp://127.0.0.1:0")
        assert cfg.scheduling_policy == "priority"
        assert make_placement(cfg).conductor.config.scheduling_policy == "priority"
    args = parser.parse_args(["cluster", "--scheduling-policy", "priority"])
    argv = worker_argv(args)
    assert argv[argv.index("--scheduling-policy") + 1] == "priority"
    defaults = parser.parse_args(["cluster"])
    assert _router_config(defaults, "tcp://127.0.0.1:0").scheduling_policy == "fcfs"
    assert "--scheduling-policy" not in worker_argv(defaults)
    with pytest.raises(SystemExit):
        parser.parse_args(["router", "--scheduling-policy", "lifo"])
    with pytest.raises(ValueError, match="scheduling_policy"):
        RouterConfig(scheduling_policy="lifo")
