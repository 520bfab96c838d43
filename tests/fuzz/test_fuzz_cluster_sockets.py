"""The cluster's ZeroMQ sockets under bad input: the router's control socket and its block-event
subscription, and a decode worker's KV socket (the KVReceiver), with real sockets in this
process. Random frames, broken headers, huge declared lengths, and replayed or out-of-order
messages of a live request. Afterwards every IO thread is alive, the router still places and
finishes a request (tokens neither lost nor repeated), and the receiver's staging arena is back
to idle."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import msgpack
import pytest
import torch
import zmq
from fuzz_frames import message_frames
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_fuzz_decoders import CLUSTER_HEADERS

from engine.cluster import messages as m
from engine.cluster.router.router import Router, RouterConfig
from engine.cluster.transfer.receiver import KVReceiver
from engine.cluster.transfer.staging import StagingArena, checksum
from engine.sampling_params import SamplingParams

START = 0.0  # when the module started (tests/fuzz/conftest.py sets it)

COUNTS = {"router_messages": 0, "event_messages": 0, "kv_messages": 0, "replays": 0}
FAST = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
LONG = settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))


def _wait(cond, timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


PW, DW = "prefill-fuzz-7f3a", "decode-fuzz-7f3a"  # ids the garbage will not hit


class Fleet:
    """A router with two scripted workers (our DEALERs) and one junk peer."""

    def __init__(self) -> None:
        self.router = Router(RouterConfig(heartbeat_timeout_s=600.0, policy="round_robin"))
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind("tcp://127.0.0.1:0")
        events = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.w: dict[str, zmq.Socket] = {}
        for wid, role in ((PW, "prefill"), (DW, "decode")):
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(self.router.address)
            reg = m.Register(wid, role, 1, "default", 4096, "tcp://127.0.0.1:9", "", "tcp", "h",
                             events_address=events if role == "prefill" else "")  # fmt: skip
            s.send_multipart(m.encode(reg))
            self.w[wid] = s
        self.junk = self.ctx.socket(zmq.DEALER)
        self.junk.setsockopt(zmq.LINGER, 0)
        self.junk.connect(self.router.address)
        self.router.wait_for_workers(1, 1, timeout=10)
        self.syncs = 0

    def sync(self) -> None:
        """Every message the junk peer sent so far was taken: a registration sent after them
        is seen (one socket, in order). Workers the junk registered are sent away."""
        self.syncs += 1
        wid = f"sync-{self.syncs}"
        self.junk.send_multipart(m.encode(m.Register(wid, "decode", 2, "d", 1, "", "", "tcp", "h")))
        _wait(lambda: wid in self.router.workers_status(), what="the router to take its input")
        assert self.router._thread.is_alive()
        for other, st_ in self.router.workers_status().items():
            if other not in (PW, DW) and st_["state"] in ("up", "draining"):
                self.junk.send_multipart(m.encode(m.Goodbye(other)))
        _wait(lambda: all(st_["state"] in ("left", "dead") for w, st_ in
                          self.router.workers_status().items() if w not in (PW, DW)),
              what="the junk's workers to leave")  # fmt: skip

    def recv(self, wid: str, timeout: float = 10.0) -> m.Message:
        s = self.w[wid]
        assert s.poll(timeout * 1000), f"{wid} got nothing: {self.router.workers_status()}"
        return m.decode(s.recv_multipart())

    def close(self) -> None:
        self.ctx.destroy(linger=0)
        self.router.close()


@pytest.fixture(scope="module")
def fleet():
    f = Fleet()
    try:
        yield f
    finally:
        f.close()


def _router_garbage(fleet: Fleet, frames: list) -> None:
    fleet.junk.send_multipart(frames)
    COUNTS["router_messages"] += 1


@FAST
@given(frames=message_frames(CLUSTER_HEADERS, "t"))
def test_router_control_socket_takes_garbage(fleet, frames):
    _router_garbage(fleet, frames)


@pytest.mark.slow
@LONG
@given(frames=message_frames(CLUSTER_HEADERS, "t"))
def test_router_control_socket_takes_garbage_long(fleet, frames):
    _router_garbage(fleet, frames)


@FAST
@given(
    event=st.one_of(
        st.binary(max_size=200),
        st.dictionaries(st.sampled_from(["type", "keys", "source", "namespace"]),
                        st.one_of(st.text(max_size=8), st.lists(st.binary(max_size=40)),
                                  st.integers(-(2**63), 2**63 - 1), st.none()),
                        max_size=4).map(msgpack.packb),
    )
)  # fmt: skip
def test_router_event_subscription_takes_garbage(fleet, event):
    fleet.pub.send(event)
    COUNTS["event_messages"] += 1


def test_router_survives_and_dedupes_replayed_out_of_order_messages(fleet):
    fleet.sync()  # the garbage above is all taken; the router is alive
    router, w = fleet.router, fleet.w
    # Messages about requests that do not exist, from registered workers: dropped.
    for wid in (PW, DW):
        for msg in (m.DecodeReady("ghost/0", 0, 64), m.TransferFailed("ghost/0", "x", True),
                    m.RequestError("ghost/0", wid, 500, "x"), m.Heartbeat("nobody", "up",
                    0, 0, 0.0, 0, 0, 0)):  # fmt: skip
            w[wid].send_multipart(m.encode(msg))
    w[DW].send_multipart(m.encode(m.Goodbye(PW)))  # another worker's goodbye: ignored
    result: dict = {}

    def client() -> None:
        async def run():
            params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
            async for out in router.generate([5, 6, 7, 8], params, request_id="req"):
                result["last"] = out

        try:
            asyncio.run(run())
        except Exception as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    t = threading.Thread(target=client, daemon=True)
    t.start()
    t.join(1.0)
    assert "error" not in result, result
    dreq = fleet.recv(DW)
    assert isinstance(dreq, m.DecodeRequest)
    wire = dreq.request_id
    ready = m.encode(m.DecodeReady(wire, 0, 64))
    for _ in range(3):  # replayed
        w[DW].send_multipart(ready)
    preq = fleet.recv(PW)
    assert isinstance(preq, m.PrefillRequest) and preq.request_id == wire
    assert not w[PW].poll(300)  # the replays started nothing more

    def out(wid, offset, tokens, text_offset, text, finish=None):
        o = dict(index=0, offset=offset, token_ids=tokens, text_offset=text_offset, text=text,
                 logprobs=None, finish_reason=finish, stop_reason=None)  # fmt: skip
        return m.encode(m.Outputs(wire, wid, [o]))

    w[PW].send_multipart(out(PW, 5, [99], 5, "z"))  # a gap: refused, not appended
    w[PW].send_multipart(out(PW, 0, [11], 0, "a"))
    w[PW].send_multipart(out(PW, 0, [11], 0, "a"))  # replayed
    w[DW].send_multipart(out(DW, 0, [11, 12], 0, "ab"))  # overlapping: only 12 is new
    w[DW].send_multipart(out(DW, 2, [], 2, "", "length"))
    w[DW].send_multipart(out(DW, 2, [], 2, "", "length"))  # after the end: dropped
    COUNTS["replays"] += 8
    t.join(timeout=20)
    assert not t.is_alive() and "error" not in result, result
    final = result["last"]
    assert final.finished and final.outputs[0].token_ids == [11, 12]
    assert final.outputs[0].text == "ab"
    fleet.sync()
    assert router.placement_of("req") is None  # nothing left in flight


# -- a decode worker's KV socket -----------------------------------------------------------

L, BS, H, D, T = 2, 4, 2, 8, 10


@pytest.fixture(scope="module")
def receiver():
    kv = torch.zeros(L, 2, 8, BS, H, D)
    arena = StagingArena(1 << 20, shared=False)
    rx = KVReceiver(kv, BS, arena)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(rx.address)
    try:
        yield rx, arena, push
    finally:
        ctx.destroy(linger=0)
        rx.close()
        arena.close()


KV_HEADERS = [
    msgpack.unpackb(m.encode(msg)[0])
    for msg in (
        m.KVLayer("live", 0, 0, 4, 1, True, frames=(b"k", b"v")),
        m.KVLayer("live", 1, 4, 10, 1, False),
        m.KVDone("live", T, L, 0, [{"index": 0, "token": 1, "generator": True}]),
        m.KVAbort("gone", "x"),
    )
]


@st.composite
def kv_layer(draw) -> list:
    """A KVLayer for the live transfer with any fields, and frames of any size."""
    layer = draw(st.integers(-2, L + 1))
    start = draw(st.integers(-2, T + 2))
    end = draw(st.integers(-2, T + 2))
    inline = draw(st.booleans())
    n = max(0, end - start) * H * D * 4
    frames = draw(st.lists(st.binary(min_size=n, max_size=n) | st.binary(max_size=32), max_size=3))
    msg = m.KVLayer("live", layer, start, end, draw(st.integers(0, 2**64 - 1)), inline)
    return [m.encode(msg)[0], *frames]


def _kv_garbage(receiver, frames) -> None:
    rx, _, push = receiver
    t = rx.get("live")
    if t is None or t.finished:  # a bad piece ended it: a fresh one, so pieces are checked
        if t is not None:
            rx.release("live")
        rx.expect("live", T, 60.0)
    push.send_multipart(frames)
    COUNTS["kv_messages"] += 1


def _sync(rx: KVReceiver, push: zmq.Socket, n: int) -> None:
    """A transfer of its own that fails at once: its event proves the earlier input was taken."""
    rid = f"sync-{n}"
    rx.expect(rid, 1, 60.0)
    push.send_multipart(m.encode(m.KVAbort(rid, "sync")))
    got = rx.events.get(timeout=10)
    while got != rid:  # the live transfer may have ended first (a bad piece)
        got = rx.events.get(timeout=10)
    rx.release(rid)
    assert rx._thread.is_alive()


@FAST
@given(frames=st.one_of(message_frames(KV_HEADERS, "t"), kv_layer()))
def test_kv_socket_takes_garbage(receiver, frames):
    _kv_garbage(receiver, frames)


@pytest.mark.slow
@LONG
@given(frames=st.one_of(message_frames(KV_HEADERS, "t"), kv_layer()))
def test_kv_socket_takes_garbage_long(receiver, frames):
    _kv_garbage(receiver, frames)


def test_kv_receiver_still_correct_and_idle_afterwards(receiver, fleet):
    rx, arena, push = receiver
    _sync(rx, push, 1)
    rx.release("live")
    _wait(lambda: arena.used == 0, what="the staging arena to be idle")
    # Good transfers after all that, layers in random order: exact bytes; and one with a
    # replayed piece, which fails cleanly (every piece exactly once is the rule).
    for rid, replay in (("good", False), ("twice", True)):
        rx.expect(rid, T, 60.0)
        data = torch.randn(L, 2, T, H, D)
        pieces = [(layer, a, b) for layer in range(L) for a, b in ((0, 3), (3, 10))]
        random.Random(0).shuffle(pieces)
        for layer, a, b in pieces + pieces[:1] * replay:
            raw = data[layer, :, a:b].contiguous().numpy().view("u1").reshape(-1)
            half = raw.nbytes // 2
            msg = m.KVLayer(rid, layer, a, b, checksum(raw), True,
                            frames=(raw[:half].tobytes(), raw[half:].tobytes()))  # fmt: skip
            push.send_multipart(m.encode(msg))
        push.send_multipart(m.encode(m.KVDone(rid, T, L, 0, [{"index": 0, "token": 1}])))
        while rx.events.get(timeout=10) != rid:
            pass
        got = rx.get(rid)
        if replay:
            assert got.error is not None and "twice" in got.error
        else:
            assert got.ok, got.error
            # TCP pieces are received into the staging area, in its layout.
            staged = arena.view(got.offset, got.layout.nbytes).view(torch.float32)
            assert torch.equal(staged.view(L, 2, T, H, D), data)
        rx.release(rid)
        _wait(lambda: arena.used == 0, what="the staging arena to be idle")
    assert rx._thread.is_alive() and fleet.router._thread.is_alive()
    from reliab_record import record_if_the_run_passes

    record_if_the_run_passes(
        "fuzz",
        "cluster-sockets",
        "router control socket and event subscription, decode KV socket: random frames, "
        "broken/truncated headers, huge declared lengths, KV pieces out of range / of wrong "
        "size / bad checksum; replayed DecodeReady and Outputs, a gap, outputs after the end",
        dict(COUNTS),
        "IO threads alive; the replayed request finished with its tokens once each; staging "
        "arena back to 0 bytes; a replayed KV piece fails its transfer cleanly",
        duration_s=time.monotonic() - START,
    )
