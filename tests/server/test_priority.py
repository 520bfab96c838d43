"""vLLM's ``priority`` request field on the OpenAI routes and the RPC API: a server under
``--scheduling-policy priority`` (here an engine on a tiny model serving one sequence at a time)
serves waiting requests lower value first; bad types and values are a 400 naming ``priority``;
a server under fcfs (the session's) takes 0 and refuses anything else with a 400 naming it."""

from __future__ import annotations

import threading
import time

import httpx
import msgpack
import pytest
from serverutil import MAX_MODEL_LEN, MODEL, RPCThread, http_server, wait_idle
from test_rpc import _raw_dealer
from tiny_models import tiny_model

from engine.client import AsyncRPCClient, RPCClient, RPCError


@pytest.fixture(scope="module")
def prio_llm():
    from engine.async_llm import AsyncLLM
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig

    engine = AsyncLLM(
        config=EngineConfig(
            model=str(tiny_model("llama")),
            dtype="float32",
            device="cpu",
            max_model_len=MAX_MODEL_LEN,
            cache=CacheConfig(num_blocks=128),
            scheduler=SchedulerConfig(max_num_seqs=1, policy="priority"),
        )
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prio_http(prio_llm):
    with http_server(prio_llm) as s, httpx.Client(base_url=s.url, timeout=60) as client:
        yield client


def body(route: str, priority) -> dict:
    out = {"model": MODEL, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    if route == "responses":
        out = {"model": MODEL, "input": "Hello", "max_output_tokens": 3, "temperature": 0}
    elif route == "chat":
        out["messages"] = [{"role": "user", "content": "Hello"}]
    else:
        out["prompt"] = "Hello"
    if priority is not ...:
        out["priority"] = priority
    return out


PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
PATHS["responses"] = "/v1/responses"


@pytest.mark.parametrize("route", PATHS)
@pytest.mark.parametrize("priority", [..., 0, -5, 7, 2**63 - 1, -(2**63)])
def test_priority_is_taken_on_both_routes(prio_http, route, priority):
    r = prio_http.post(PATHS[route], json=body(route, priority))
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage.get("completion_tokens", usage.get("output_tokens")) in range(1, 4)


@pytest.mark.parametrize("route", PATHS)
@pytest.mark.parametrize("priority", ["1", True, 1.5, None, [1], 2**63, -(2**63) - 1])
def test_bad_priority_is_a_400_naming_it(prio_http, prio_llm, route, priority):
    r = prio_http.post(PATHS[route], json=body(route, priority))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "priority", r.json()
    wait_idle(prio_llm)


@pytest.mark.parametrize("route", PATHS)
def test_fcfs_server_refuses_a_priority_with_a_400_naming_it(http, route):
    assert http.post(PATHS[route], json=body(route, 0)).status_code == 200
    r = http.post(PATHS[route], json=body(route, 2))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "priority" and "priority scheduling is not enabled" in err["message"]


def served_in_order(send, priorities, llm, hold) -> list[int]:
    """With the only sequence slot held by ``hold`` (a context that keeps a request running
    until it exits), send one request per priority from its own thread, wait until all wait in
    the engine's queue, let go of the slot: the indices of the requests in the order they ended
    (they run one at a time)."""
    ended: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def one(i: int, priority: int) -> None:
        try:
            send(priority)
            with lock:
                ended.append(i)
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    with hold():
        threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(priorities)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(llm.engine.scheduler.waiting) < len(priorities):
            assert time.monotonic() < deadline, "the requests did not all queue up"
            time.sleep(0.01)
    for t in threads:
        t.join(60)
    assert not errors, errors
    return ended


LONG = {"max_tokens": 900, "temperature": 0, "ignore_eos": True}


def test_http_serves_waiting_requests_lower_priority_first(prio_http, prio_llm):
    def hold():
        # A stream that holds the slot until the test closes it (the server aborts it).
        return prio_http.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": "x", "stream": True, **LONG,
        })  # fmt: skip

    def send(priority):
        r = prio_http.post(PATHS["chat"], json=body("chat", priority))
        assert r.status_code == 200, r.text

    assert served_in_order(send, [9, 1, -4, 1], prio_llm, hold) == [2, 1, 3, 0]
    wait_idle(prio_llm)


@pytest.fixture(scope="module")
def prio_rpc(prio_llm):
    with RPCThread(prio_llm) as server:
        yield server


def test_rpc_serves_waiting_requests_lower_priority_first(prio_rpc, prio_llm):
    client = RPCClient(prio_rpc.address, timeout=60)

    class hold:
        def __enter__(self):
            self.stream = client.stream("x", **LONG)
            next(self.stream)

        def __exit__(self, *exc):
            self.stream.close()  # aborts it

    def send(priority):
        with RPCClient(prio_rpc.address, timeout=60) as c:
            assert len(c.generate("Hi", max_tokens=3, priority=priority).outputs[0].token_ids)

    try:
        assert served_in_order(send, [3, -1, 0], prio_llm, hold) == [1, 2, 0]
    finally:
        client.close()
    wait_idle(prio_llm)


@pytest.mark.parametrize("priority", ["1", True, 1.5, [1], 2**63, -(2**63) - 1])
def test_rpc_bad_priority_is_a_400_naming_it(prio_rpc, priority):
    with RPCClient(prio_rpc.address, timeout=60) as c:
        with pytest.raises(RPCError) as info:
            c.generate("Hi", max_tokens=2, priority=priority)
        assert info.value.code == 400 and info.value.param == "priority", info.value.message
        assert c.generate("Hi", max_tokens=2, priority=-3).outputs[0].token_ids


@pytest.mark.parametrize("priority", [2**63, 2**64 - 1, "high", None])
def test_rpc_server_checks_the_wire_field_itself(prio_rpc, priority):
    """What another client might send (ours refuses out-of-range ints before sending)."""
    sock = _raw_dealer(prio_rpc.address)
    try:
        sock.send(msgpack.packb({"id": 1, "op": "generate", "prompt": "Hi", "priority": priority}))
        reply = msgpack.unpackb(sock.recv(), raw=False)
    finally:
        sock.close()
    assert reply["type"] == "error" and reply["id"] == 1
    assert reply["error"]["code"] == 400 and reply["error"]["param"] == "priority"


def test_rpc_fcfs_server_refuses_a_priority_naming_it(llm):
    import asyncio

    with RPCThread(llm) as server:
        with RPCClient(server.address, timeout=60) as c:
            assert c.generate("Hi", max_tokens=2, priority=0).outputs[0].token_ids
            with pytest.raises(RPCError) as info:
                list(c.stream("Hi", max_tokens=2, priority=1))
            assert info.value.code == 400 and info.value.param == "priority"

        async def via_async() -> RPCError:
            async with AsyncRPCClient(server.address, timeout=60) as ac:
                with pytest.raises(RPCError) as info:
                    await ac.generate("Hi", max_tokens=2, priority=-1)
                return info.value

        err = asyncio.run(via_async())
        assert err.code == 400 and err.param == "priority"
