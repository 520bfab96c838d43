"""The ZeroMQ RPC server and its clients: round trips, streaming, abort, deadlines, and frames
that are not requests."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import zmq
from serverutil import MODEL, RPCThread, wait_idle

from engine.client import AsyncRPCClient, RPCClient, RPCError, RPCTimeoutError
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def rpc(llm):
    with RPCThread(llm) as server:
        yield server


@pytest.fixture
def client(rpc):
    with RPCClient(rpc.address, timeout=60) as c:
        yield c


def test_health_and_metrics(client):
    h = client.health()
    assert h["healthy"] and h["model"] == MODEL and h["max_model_len"] > 0
    m = client.metrics()
    assert {"num_running", "kv_usage", "ttft"} <= set(m)


def test_generate_matches_stream(client):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    result = client.generate("The capital of France is", params)
    c = result.outputs[0]
    assert len(c.token_ids) == 6 and c.finish_reason == "length" and result.text
    assert result.usage.completion_tokens == 6 and result.usage.prompt_tokens > 0
    assert len(c.logprobs) == 6 and all(lp.logprob <= 0 for lp in c.logprobs)
    deltas = list(client.stream("The capital of France is", params))
    assert "".join(d.text for d in deltas) == result.text
    assert [t for d in deltas for t in d.outputs[0].token_ids] == c.token_ids
    assert deltas[-1].outputs[0].finish_reason == "length"


def test_n_and_token_ids(client):
    ids = [1, 504, 3458, 314]
    r = client.generate(ids, max_tokens=4, temperature=1.0, n=2, seed=3)
    assert sorted(c.index for c in r.outputs) == [0, 1]
    again = client.generate(ids, max_tokens=4, temperature=1.0, n=2, seed=3)
    assert [c.token_ids for c in r.outputs] == [c.token_ids for c in again.outputs]


def test_errors_name_the_field(client):
    with pytest.raises(RPCError) as info:
        client.generate("Hi", max_tokens=2, temperature=-1.0)
    assert info.value.code == 400 and info.value.param == "temperature"
    with pytest.raises(RPCError) as info:
        client.generate("Hi", max_tokens=2, bogus=1)
    assert info.value.code == 400 and "bogus" in info.value.message
    with pytest.raises(RPCError) as info:
        client.generate("word " * 2000, max_tokens=2)
    assert info.value.code == 400 and info.value.param == "prompt"


def test_a_bug_is_an_internal_error_and_the_server_keeps_serving(client, llm, monkeypatch):
    def broken(ids, params):
        raise ValueError("temperature must be a bug")  # reads like bad input; it is a bug

    monkeypatch.setattr(llm.engine, "validate", broken)
    with pytest.raises(RPCError) as info:
        client.generate("Hi", max_tokens=2)
    assert info.value.code == 500 and info.value.param is None
    assert info.value.type == "InternalServerError" and "temperature" not in info.value.message
    monkeypatch.undo()
    assert client.generate("Hi", max_tokens=2).outputs[0].token_ids


def test_abort_and_early_close_free_kv(client, llm):
    aborted = llm.metrics().finished.get("abort", 0)
    stream = client.stream("Count:", max_tokens=400, ignore_eos=True, request_id="mine")
    next(stream)
    assert client.abort("mine") is True
    rest = list(stream)
    assert rest and rest[-1].outputs[0].finish_reason == "abort"
    assert client.abort("mine") is False  # finished: a no-op
    stream = client.stream("Count:", max_tokens=400, ignore_eos=True)
    next(stream)
    stream.close()  # the client sends an abort for it
    wait_idle(llm)
    assert llm.metrics().finished.get("abort", 0) == aborted + 2


def test_deadline(client, llm):
    with pytest.raises(RPCTimeoutError):
        client.generate("Count:", max_tokens=400, ignore_eos=True, timeout=0.5)
    wait_idle(llm)
    assert client.health()["healthy"]


def test_malformed_frames_get_error_replies(rpc, client):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(rpc.address)
    try:
        bad = [
            b"",
            b"\xc1",
            b"not msgpack at all \xff\xfe",
            msgpack.packb([1, 2, 3]),
            msgpack.packb({"op": "fly"}),
            msgpack.packb({"id": 5, "op": "generate"}),
            msgpack.packb({"id": 6, "op": "generate", "prompt": "x", "params": [1]}),
            msgpack.packb({"id": 7, "op": "generate", "prompt": [1, "a"]}),
            msgpack.packb({"id": 8, "op": "generate", "prompt": "x", "timeout": -1}),
            msgpack.packb({"id": 9, "op": "stream", "prompt": "x", "params": {"n": 10**6}}),
            msgpack.packb({"id": [1], "op": "health"}),
            msgpack.packb({1: 2}),
            msgpack.packb({"id": 10, "op": "abort"}),
            msgpack.packb({"id": 11, "op": "generate", "prompt": "x", "params": {"stop": 5}}),
        ]
        for frame in bad:
            sock.send(frame)
            reply = msgpack.unpackb(sock.recv(), raw=False)
            assert reply["type"] == "error", (frame, reply)
            assert reply["error"]["code"] == 400, (frame, reply)
        sock.send_multipart([b"a", b"b", msgpack.packb({"id": 12, "op": "health"})])
        reply = msgpack.unpackb(sock.recv_multipart()[-1], raw=False)
        assert reply["type"] == "ok"
    finally:
        sock.close()
    assert client.generate("Hi", max_tokens=2).outputs  # still serving


def test_async_client(rpc, llm):
    async def main():
        async with AsyncRPCClient(rpc.address, timeout=60) as c:
            health = await c.health()
            results = await asyncio.gather(
                *(c.generate(f"Story {i}:", max_tokens=4, ignore_eos=True) for i in range(8))
            )
            text = ""
            async for d in c.stream("Hello", max_tokens=4, temperature=0.0):
                text += d.text
            with pytest.raises(RPCError):
                await c.generate("Hi", max_tokens=0)
            gen = c.stream("Count:", max_tokens=400, ignore_eos=True)
            await anext(gen)
            await gen.aclose()  # aborts
            return health, results, text

    health, results, text = asyncio.run(main())
    assert health["healthy"]
    assert all(len(r.outputs[0].token_ids) == 4 for r in results)
    assert text
    wait_idle(llm)


def test_peer_that_vanishes_is_aborted(rpc, llm):
    """A client that sends a stream request and disappears does not hold KV forever."""
    aborted = llm.metrics().finished.get("abort", 0)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(rpc.address)
    req = {"id": 1, "op": "stream", "prompt": "Count:", "params": {"max_tokens": 400}}
    req["params"]["ignore_eos"] = True
    sock.send(msgpack.packb(req))
    sock.recv()  # the first chunk
    sock.close()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and llm.metrics().finished.get("abort", 0) == aborted:
        time.sleep(0.05)
    wait_idle(llm)
    assert llm.metrics().finished.get("abort", 0) == aborted + 1


def test_no_server_means_a_timeout_not_a_hang():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with RPCClient(f"tcp://127.0.0.1:{port}", timeout=0.3) as c:
        t0 = time.monotonic()
        with pytest.raises(RPCTimeoutError):
            c.health()
        assert time.monotonic() - t0 < 2


def _raw_dealer(address: str, **opts) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    for name, value in opts.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(address)
    return sock


def test_long_id_is_refused_not_echoed(rpc):
    """A client-chosen id is echoed in every reply: a long one would multiply what a peer that
    never reads makes the server hold. It is a 400 naming the field, without the id."""
    sock = _raw_dealer(rpc.address)
    try:
        sock.send(msgpack.packb({"id": "x" * 100_000, "op": "health"}))
        reply = msgpack.unpackb(sock.recv(), raw=False)
        assert reply["type"] == "error" and reply["error"]["param"] == "id"
        assert reply["id"] is None and "256" in reply["error"]["message"]
    finally:
        sock.close()


def test_oversized_frame_gets_a_413_naming_the_limit(rpc, client):
    from engine.server.rpc_server import MAX_MESSAGE_BYTES

    sock = _raw_dealer(rpc.address)
    try:
        frame = msgpack.packb({"id": 1, "op": "generate", "prompt": "x" * MAX_MESSAGE_BYTES})
        sock.send(frame)
        reply = msgpack.unpackb(sock.recv(), raw=False)  # before the fix: no reply at all
        assert reply["type"] == "error" and reply["error"]["code"] == 413
        assert str(MAX_MESSAGE_BYTES) in reply["error"]["message"]
    finally:
        sock.close()
    with pytest.raises(RPCError) as info:  # our client refuses before sending
        client.generate("x" * MAX_MESSAGE_BYTES)
    assert info.value.code == 413
    assert client.health()["healthy"]


def test_peer_that_never_reads_is_aborted(llm):
    """A peer that starts streams and never reads fills its bounded reply queue; then its calls
    are aborted and their KV freed, instead of replies piling up in the server's memory."""
    aborted = llm.metrics().finished.get("abort", 0)
    with RPCThread(llm, send_hwm=20, send_buffer_bytes=4096) as server:
        sock = _raw_dealer(server.address, RCVHWM=1, RCVBUF=4096)
        try:
            for i in range(8):
                params = {"max_tokens": 600, "ignore_eos": True}
                sock.send(
                    msgpack.packb({"id": i, "op": "stream", "prompt": "Count:", "params": params})
                )
            deadline = time.monotonic() + 120
            while llm.metrics().finished.get("abort", 0) < aborted + 8:
                assert time.monotonic() < deadline, llm.metrics().finished
                time.sleep(0.1)
        finally:
            sock.close()
    wait_idle(llm)
