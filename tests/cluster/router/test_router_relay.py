"""What the router tells a decode worker for the case that its KV never all arrives: the first
tokens it relayed to the client (FirstTokens), and, when the prefill worker dies after them,
that the KV's source is gone (SourceGone), so a transfer across hosts fails at once instead of
waiting out its deadline; and what a worker declared dead still holds, once it is back.
Scripted workers: real ZeroMQ sockets driven from this thread, on two "hosts"; no model runs."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import zmq

from engine.cluster import messages as m
from engine.cluster.router.router import Router, RouterConfig
from engine.sampling_params import SamplingParams
from tests.cluster.router.scripted_workers import Scripted, pump_until


def test_decode_worker_gets_the_first_tokens_and_hears_of_the_prefill_workers_death():
    router = Router(RouterConfig(heartbeat_timeout_s=1.0))
    p, d = Scripted(router, "p0", "prefill"), Scripted(router, "d0", "decode")
    outputs: list = []

    def client():
        async def run():
            params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
            async for out in router.generate([11, 12, 13, 14], params, request_id="r"):
                outputs.append(out)

        asyncio.run(run())

    thread = threading.Thread(target=client, daemon=True)
    try:
        pump_until([p, d], lambda: len(router.workers) == 2, "registration")
        thread.start()
        req = pump_until([p, d], lambda: d.first(m.DecodeRequest), "the DecodeRequest")
        d.send(m.DecodeReady(req.request_id, 0, 4096))
        pre = pump_until([p, d], lambda: p.first(m.PrefillRequest), "the PrefillRequest")
        assert pre.request_id == req.request_id
        first = {"index": 0, "offset": 0, "token_ids": [42], "logprobs": None, "text_offset": 0,
                 "text": "x", "finish_reason": None, "stop_reason": None}  # fmt: skip
        p.send(m.Outputs(req.request_id, "p0", [first]))
        relayed = pump_until([p, d], lambda: d.first(m.FirstTokens), "FirstTokens")
        assert relayed.request_id == req.request_id and relayed.outputs == [first]
        assert d.first(m.SourceGone) is None
        p.alive = False  # SIGKILLed: its heartbeats stop
        gone = pump_until([p, d], lambda: d.first(m.SourceGone), "SourceGone")
        assert (gone.request_id, gone.worker_id) == (req.request_id, "p0")
        assert not d.first(m.Abort)  # the decode worker carries the request on
        rest = {"index": 0, "offset": 1, "token_ids": [7, 8, 9], "logprobs": None, "text_offset": 1,
                "text": "yzw", "finish_reason": "length", "stop_reason": None}  # fmt: skip
        d.send(m.Outputs(req.request_id, "d0", [rest]))
        pump_until([p, d], lambda: outputs and outputs[-1].finished, "the end of the request")
        assert outputs[-1].outputs[0].token_ids == [42, 7, 8, 9]
    finally:
        thread.join(10)
        router.close()
        for w in (p, d):
            w.sock.close(linger=0)


def client_thread(router: Router, errors: list) -> threading.Thread:
    """A client's request "r" through the router (not started); its error lands in errors."""

    def client():
        async def run():
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            try:
                async for _ in router.generate([11, 12, 13, 14], params, request_id="r"):
                    pass
            except Exception as exc:
                errors.append(exc)

        asyncio.run(run())

    return threading.Thread(target=client, daemon=True)


def test_a_worker_back_from_a_partition_is_told_to_drop_what_was_given_up():
    """A decode worker silent past the heartbeat timeout (cut off, alive) is declared dead and
    its request fails; when the same process registers again (its link came back) the router
    aborts that attempt there, so its staging area and blocks come back at once instead of at
    its transfer deadline (120 s by default). A restarted process (another pid) holds nothing:
    it gets no Abort."""
    router = Router(RouterConfig(heartbeat_timeout_s=1.0))
    p, d = Scripted(router, "p0", "prefill"), Scripted(router, "d0", "decode")
    errors: list = []
    thread = client_thread(router, errors)
    try:
        pump_until([p, d], lambda: len(router.workers) == 2, "registration")
        thread.start()
        req = pump_until([p, d], lambda: d.first(m.DecodeRequest), "the DecodeRequest")
        d.alive = False  # partitioned: no heartbeat reaches the router
        pump_until([p], lambda: router.workers["d0"].state == "dead", "d0 declared dead")
        pump_until([p], lambda: errors, "the request's error")
        assert "died" in str(errors[0]) or "no live" in str(errors[0]), errors
        assert not d.first(m.Abort)
        d.alive = True
        d.register()  # the link is back: the worker's periodic registration arrives
        abort = pump_until([p, d], lambda: d.first(m.Abort), "the Abort of the abandoned attempt")
        assert abort.request_id == req.request_id
        assert router.workers["d0"].state == "up" and router.workers["d0"].abandoned == []
        d.alive = False  # once more, but a restarted process comes back: nothing to abort
        pump_until([p], lambda: router.workers["d0"].state == "dead", "d0 dead again")
        d.inbox.clear()
        d.alive = True
        d.register(pid=os.getpid() + 1)
        pump_until([p, d], lambda: router.workers["d0"].pid == os.getpid() + 1, "the new pid")
        time.sleep(0.3)
        d.pump()
        assert not d.first(m.Abort)
    finally:
        thread.join(10)
        router.close()
        for w in (p, d):
            w.sock.close(linger=0)


def test_an_abort_that_could_not_be_sent_goes_when_the_worker_registers_again():
    """The router gives up on a request (its prefill worker died) while the decode worker's
    connection is down but its heartbeats still count (ZeroMQ's heartbeats dropped the
    connection first): the Abort cannot be sent, so it goes once that worker registers again
    over its new connection, and the staging area it holds is not kept to its deadline."""
    router = Router(RouterConfig(heartbeat_timeout_s=1.0))
    p, d = Scripted(router, "p0", "prefill"), Scripted(router, "d0", "decode")
    errors: list = []
    thread = client_thread(router, errors)
    try:
        pump_until([p, d], lambda: len(router.workers) == 2, "registration")
        thread.start()
        req = pump_until([p, d], lambda: d.first(m.DecodeRequest), "the DecodeRequest")
        d.send(m.DecodeReady(req.request_id, 0, 4096))
        pump_until([p, d], lambda: p.first(m.PrefillRequest), "the PrefillRequest")
        d.sock.close(linger=0)  # its connection is gone; its heartbeats go on over a new one
        d.sock = zmq.Context.instance().socket(zmq.DEALER)
        d.sock.setsockopt(zmq.LINGER, 0)
        d.sock.connect(router.address)
        d.inbox.clear()
        p.alive = False
        pump_until([p, d], lambda: errors, "the request's error")
        assert router.workers["d0"].state == "up"
        assert router.workers["d0"].abandoned == [req.request_id]
        d.register()  # the same process registers again, over the new connection
        abort = pump_until([p, d], lambda: d.first(m.Abort), "the Abort, late")
        assert abort.request_id == req.request_id and router.workers["d0"].abandoned == []
    finally:
        thread.join(10)
        router.close()
        for w in (p, d):
            w.sock.close(linger=0)
