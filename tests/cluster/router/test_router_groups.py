"""Pipelined prefill groups in the router: a group is one prefill unit once every stage has
registered (and down when one leaves), the Conductor places on it with its pipelined TTFT, a
request placed there reaches every stage with the next stage's hidden-state endpoint, the decode
worker waits for one KVDone per stage, and a stage's death or refusal aborts every leg and
places the request again. Scripted workers (real ZeroMQ sockets, no model)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from engine.cluster import messages as m
from engine.cluster.conductor.adapter import make_placement
from engine.cluster.placement import RoundRobin
from engine.cluster.router.config import RouterConfig
from engine.cluster.router.membership import Membership
from engine.cluster.router.router import Router
from engine.sampling_params import SamplingParams
from tests.cluster.router.scripted_workers import Scripted, pump_until
from tests.cluster.router.test_membership import NoLinks


def stage_register(wid: str, group: str, stage: int, stages: int, chunk: int = 512,
                   pid: int = 1234) -> m.Register:  # fmt: skip
    hidden = f"tcp://127.0.0.1:{7000 + stage}" if stage else ""
    return m.Register(wid, "prefill", pid, "default", 1024, "", "", "tcp", "h", group=group,
                      stage=stage, stages=stages, chunk_tokens=chunk,
                      hidden_address=hidden)  # fmt: skip


def test_a_group_is_one_prefill_unit_while_every_stage_is_up():
    ms = Membership(RouterConfig(), 1024, RoundRobin(), NoLinks())
    assert ms.register(b"a", stage_register("g-0", "g", 0, 2), 1.0) is not None
    assert ms.live("prefill") == [] and not ms.serving()
    assert ms.register(b"b", stage_register("g-1", "g", 1, 2), 1.0) is not None
    ms.register(b"d", m.Register("d0", "decode", 9, "default", 1024, "", "", "tcp", "h"), 1.0)
    (unit,) = ms.live("prefill")
    assert (unit.worker_id, unit.stages, unit.chunk_tokens) == ("group:g", 2, 512)
    assert [w.worker_id for w in ms.stage_workers("group:g")] == ["g-0", "g-1"]
    assert ms.serving() and ms.count_groups_up() == 1 and ms.count_up("prefill") == 0
    ms.gone(ms.workers["g-1"], "dead")
    assert ms.live("prefill") == [] and ms.stage_workers("group:g") is None
    ms.register(b"c", stage_register("g-1", "g", 1, 2, pid=99), 2.0)  # rejoins: up again
    assert [u.worker_id for u in ms.live("prefill")] == ["group:g"]


def test_stages_that_disagree_with_their_group_are_refused():
    ms = Membership(RouterConfig(), 1024, RoundRobin(), NoLinks())
    ms.register(b"a", stage_register("g-0", "g", 0, 2), 1.0)
    assert ms.register(b"b", stage_register("g-1", "g", 1, 3), 1.0) is None  # 3 stages, not 2
    assert ms.register(b"b", stage_register("g-1", "g", 1, 2, chunk=64), 1.0) is None
    assert ms.register(b"b", stage_register("x-0", "g", 0, 2), 1.0) is None  # stage 0 is taken
    no_endpoint = m.Register("g-1", "prefill", 1, "default", 1024, "", "", "tcp", "h",
                             group="g", stage=1, stages=2, chunk_tokens=512)  # fmt: skip
    assert ms.register(b"b", no_endpoint, 1.0) is None  # the stage before could not reach it
    assert ms.register(b"b", stage_register("g-1", "g", 2, 2), 1.0) is None  # no stage 2 of 2
    assert ms.live("prefill") == []


def test_the_conductor_sees_a_group_with_its_pipeline_shape():
    placement = make_placement(RouterConfig())
    ms = Membership(RouterConfig(), 1024, placement, NoLinks())
    ms.register(b"a", stage_register("g-0", "g", 0, 2, chunk=256), 1.0)
    ms.register(b"b", stage_register("g-1", "g", 1, 2, chunk=256), 1.0)
    shape = placement.conductor._prefills["group:g"].shape
    assert (shape.stages, shape.chunk_tokens) == (2, 256)
    ms.gone(ms.workers["g-0"], "left")
    assert "group:g" not in placement.conductor._prefills


def client(router: Router, outputs: list) -> threading.Thread:
    def run():
        async def go():
            params = SamplingParams(max_tokens=3, ignore_eos=True)
            try:
                async for out in router.generate(list(range(11, 51)), params, request_id="r"):
                    outputs.append(out)
            except Exception as exc:
                outputs.append(exc)

        asyncio.run(go())

    return threading.Thread(target=run, daemon=True)


FIRST = {"index": 0, "offset": 0, "token_ids": [42], "logprobs": None, "text_offset": 0,
         "text": "x", "finish_reason": None, "stop_reason": None}  # fmt: skip


@pytest.fixture
def group():
    """A router with a 2-stage group g and a decode worker d0 up, a client's request "r" on its
    way (started), and what the client got so far."""
    router = Router(RouterConfig(heartbeat_timeout_s=1.5, policy="round_robin"))
    s0 = Scripted(router, "g-0", reg=stage_register("g-0", "g", 0, 2))
    s1 = Scripted(router, "g-1", reg=stage_register("g-1", "g", 1, 2))
    decode = m.Register("d0", "decode", os.getpid(), "default", 1024, "tcp://127.0.0.1:7100", "",
                        "tcp", "h")  # fmt: skip
    d = Scripted(router, "d0", "decode", reg=decode)
    ws, outputs = [s0, s1, d], []
    thread = client(router, outputs)
    try:
        pump_until(ws, lambda: router.is_healthy(), "the group and the decode worker")
        thread.start()
        yield router, s0, s1, d, outputs
    finally:
        thread.join(10)
        router.close()
        for w in ws:
            w.close()


def test_a_request_placed_on_a_group_reaches_every_stage_and_ends_through_the_last(group):
    router, s0, s1, d, outputs = group
    ws = [s0, s1, d]
    (req,) = pump_until(ws, lambda: d.all(m.DecodeRequest), "the DecodeRequest")
    assert req.senders == 2 and req.sender_pid == 0  # one KVDone per stage, no pid to watch
    assert req.stage_pids == [-1, -1]  # neither stage proved it shares d0's memory: frames
    d.send(m.DecodeReady(req.request_id, 0, 4096))
    (p0,) = pump_until(ws, lambda: s0.all(m.PrefillRequest), "stage 0's PrefillRequest")
    (p1,) = pump_until(ws, lambda: s1.all(m.PrefillRequest), "stage 1's PrefillRequest")
    assert p0.stage_next == "tcp://127.0.0.1:7001" and p1.stage_next == ""
    assert p0.prefix_tokens == 0 and p1.prefix_tokens == -1  # nothing cached on the stages
    assert p0.kv_address == p1.kv_address == "tcp://127.0.0.1:7100"
    assert p0.transport == p1.transport == "tcp"
    assert router.placement_of("r")[1] == "group:g"
    s0.send(m.Outputs(req.request_id, "g-0", [FIRST]))  # only the last stage's count
    time.sleep(0.2)
    pump_until(ws, lambda: True, "a pump")
    assert not d.all(m.FirstTokens)
    s1.send(m.Outputs(req.request_id, "g-1", [FIRST]))
    pump_until(ws, lambda: d.all(m.FirstTokens), "FirstTokens from the last stage")
    rest = {**FIRST, "offset": 1, "token_ids": [7, 8], "text_offset": 1, "text": "yz",
            "finish_reason": "length"}  # fmt: skip
    d.send(m.Outputs(req.request_id, "d0", [rest]))
    pump_until(ws, lambda: outputs and getattr(outputs[-1], "finished", True), "the end")
    assert outputs[-1].outputs[0].token_ids == [42, 7, 8]


def test_a_stage_refusing_or_dying_aborts_every_leg_and_the_request_is_placed_again(group):
    router, s0, s1, d, outputs = group
    ws = [s0, s1, d]
    (req,) = pump_until(ws, lambda: d.all(m.DecodeRequest), "the DecodeRequest")
    d.send(m.DecodeReady(req.request_id, 0, 4096))
    pump_until(ws, lambda: s1.all(m.PrefillRequest), "stage 1's PrefillRequest")
    # Stage 1 lacks the prefix (or its hidden states failed): 503, placed again.
    s1.send(m.RequestError(req.request_id, "g-1", 503, "stage 1/2: prefix missing"))
    for w in ws:
        aborted = lambda w=w: any(a.request_id == req.request_id for a in w.all(m.Abort))  # noqa: E731
        pump_until(ws, aborted, f"{w.wid}'s Abort")
    again = pump_until(ws, lambda: [r for r in d.all(m.DecodeRequest) if r is not req],
                       "the second attempt")  # fmt: skip
    assert again[0].request_id != req.request_id and again[0].senders == 2
    d.send(m.DecodeReady(again[0].request_id, 0, 4096))
    pump_until(ws, lambda: len(s0.all(m.PrefillRequest)) == 2, "stage 0's second request")
    s1.alive = False  # SIGKILLed mid-prefill: the group goes down, every leg is aborted
    pump_until(ws, lambda: any(a.request_id == again[0].request_id for a in s0.all(m.Abort)),
               "stage 0's Abort")  # fmt: skip
    assert router.workers_status()["g-1"]["state"] == "dead"
    assert router.workers_status()["g-0"]["stage"] == "0/2"
    # No other prefill unit: the request ends with a clear error, not a hang.
    pump_until(ws, lambda: outputs and isinstance(outputs[-1], Exception), "the error")
    assert "prefill" in str(outputs[-1]) or "worker" in str(outputs[-1])
