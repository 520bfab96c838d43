"""What a new user meets first: one-line errors for a taken port or a bad RPC address (before
the model loads), a KV cache sized for the model, messages that say what is wrong, and the
choices made as vLLM would (docs served, /v1/models without file paths, Bearer in any case)."""

from __future__ import annotations

import socket

import httpx
import msgpack
import pytest
import zmq
from serverutil import MODEL, RPCThread, http_server

from engine.cli.main import main


def test_port_in_use_is_one_line_before_the_model_loads(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port), "--model", "/no/such/model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot listen on 127.0.0.1:{port}" in err[0], err


def test_bad_rpc_address_is_one_line(capsys):
    assert main(["rpc", "--address", "tcp://no-such-host-name:99999", "--model", "/nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot bind the RPC address" in err[0], err


def test_default_kv_cache_is_sized_for_the_model():
    from engine.config import CPU_KV_DEFAULT_SEQS, CacheConfig

    sized, line = CacheConfig().sized_for(
        bytes_per_token=46080, max_model_len=8192, max_num_seqs=128
    )
    assert sized.kv_cache_memory_gb == pytest.approx(46080 * 8192 * CPU_KV_DEFAULT_SEQS / 1024**3)
    assert "4 sequences of 8192 tokens" in line and "--kv-cache-memory-gb" in line
    given = CacheConfig(kv_cache_memory_gb=1.0)
    assert given.sized_for(46080, 8192, 128) == (given, "")
    huge, line = CacheConfig().sized_for(10**12, 8192, 128)  # far more than available
    assert "capped" in line


def test_image_part_message_names_the_part_type(http):
    part = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    messages = [{"role": "user", "content": [part]}]
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages"
    assert "'image_url'" in err["message"] and "str" not in err["message"]


def test_models_root_is_the_name_not_a_file_path(http):
    card = http.get("/v1/models").json()["data"][0]
    assert card["root"] == MODEL and "/" not in card["root"]


def test_bearer_scheme_is_case_insensitive_and_docs_are_public(llm):
    with http_server(llm, api_key="k3y") as s:
        for scheme in ("Bearer", "bearer", "BEARER"):
            r = httpx.get(s.url + "/v1/models", headers={"Authorization": f"{scheme} k3y"})
            assert r.status_code == 200, scheme
        assert (
            httpx.get(s.url + "/v1/models", headers={"Authorization": "Basic k3y"}).status_code
            == 401
        )
        assert httpx.get(s.url + "/openapi.json").status_code == 200
        assert httpx.get(s.url + "/metrics").status_code == 401


@pytest.fixture(scope="module")
def rpc(llm):
    with RPCThread(llm) as server:
        yield server


@pytest.mark.parametrize(
    "frame, words",
    [
        ({"id": 1, "op": "generate", "prompt": "x", "params": {"max_tokens": "3"}}, "an integer"),
        (
            {"id": 2, "op": "generate", "prompt": "x", "params": {"stop_token_ids": "abc"}},
            "integers",
        ),
        ({"id": 3, "op": "generate", "prompt": "x", "params": {"temperature": "hot"}}, "a number"),
        (b"\x91" * 5000 + b"\x00", "nests deeper"),
    ],
)
def test_rpc_messages_say_what_is_wrong(rpc, frame, words):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(rpc.address)
    try:
        sock.send(frame if isinstance(frame, bytes) else msgpack.packb(frame))
        reply = msgpack.unpackb(sock.recv(), raw=False)
    finally:
        sock.close()
    assert reply["type"] == "error" and reply["error"]["code"] == 400
    assert words in reply["error"]["message"], reply
