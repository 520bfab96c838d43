"""Slow clients and connection caps (http_limits.py): read deadlines give a 408, stalled
readers are closed to make room for new connections, a full server answers an OpenAI-shaped
429 with Retry-After, and /health stays answerable throughout."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from serverutil import http_server, wait_idle

from engine.server.http_limits import HTTPLimits

SMALL = HTTPLimits(
    max_connections=16,
    max_connections_per_client=16,
    header_timeout_s=1.0,
    body_timeout_s=1.5,
    stall_s=0.2,
)
HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: 1000\r\n\r\n"
)


@pytest.fixture(scope="module")
def limited(llm):
    with http_server(llm, limits=SMALL) as s:
        yield s


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _read_response(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_slow_head_and_slow_body_get_408(limited):
    head_only = _connect(limited.url)
    head_only.sendall(HEAD[:30])  # part of the request line, then nothing
    body_slow = _connect(limited.url)
    body_slow.sendall(HEAD + b"{")  # the head, then one byte of a 1,000-byte body
    try:
        status, body = _read_response(head_only)  # closed at the head deadline
        assert status == 408 and "request head" in body["error"]["message"]
        status, body = _read_response(body_slow)
        assert status == 408 and "request body" in body["error"]["message"]
        assert body["error"]["type"] == "TimeoutError"
    finally:
        head_only.close()
        body_slow.close()


def test_slowloris_cannot_lock_out_other_clients(limited, llm):
    """Slow clients holding every connection: new clients still get served (the stalled
    readers are closed to make room), /health included. Before, uvicorn answered every new
    request with a plain-text 503 for as long as the slow clients liked."""
    slow = []
    try:
        for _ in range(SMALL.max_connections):
            s = _connect(limited.url)
            s.sendall(HEAD + b"{")
            slow.append(s)
        time.sleep(SMALL.stall_s * 2)
        with httpx.Client(base_url=limited.url, timeout=30) as c:
            assert c.get("/health").status_code == 200
            r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["choices"]
    finally:
        for s in slow:
            s.close()
    wait_idle(llm)


def test_full_server_answers_429_and_health(llm):
    """Every connection busy with a request it sent in time: a new connection's requests get
    the documented 429 (OpenAI-shaped, Retry-After, counted), /health still gets 200."""
    limits = HTTPLimits(max_connections=2, max_connections_per_client=2)
    with http_server(llm, limits=limits) as s:
        body = {"prompt": "Count:", "max_tokens": 400, "ignore_eos": True, "stream": True}
        streams = [httpx.Client(base_url=s.url, timeout=60) for _ in range(2)]
        responses, lines = [], []
        try:
            for c in streams:
                r = c.send(c.build_request("POST", "/v1/completions", json=body), stream=True)
                lines.append(r.iter_lines())  # kept: dropping the iterator closes the stream
                next(lines[-1])
                responses.append(r)
            r = httpx.get(s.url + "/v1/models")
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "RateLimitError"
            assert httpx.get(s.url + "/health").status_code == 200
        finally:
            for r in responses:
                r.close()
            for c in streams:
                c.close()
        wait_idle(llm)
        metrics = httpx.get(s.url + "/metrics").text
        assert 'reason="too_many_connections"} 2.0' in metrics, metrics[-800:]


@pytest.mark.slow
def test_slowloris_with_2047_connections(llm):
    """The attack as reported, against the default limits: 2,047 connections that send a head
    and then a byte now and then. /health and a completion are still served."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4500:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    with http_server(llm) as server:
        slow = []
        try:
            for _ in range(2047):
                s = _connect(server.url)
                s.sendall(HEAD + b"{")
                slow.append(s)
            time.sleep(1.5)
            for s in slow[:100]:
                try:
                    s.sendall(b" ")
                except OSError:
                    pass
            with httpx.Client(base_url=server.url, timeout=60) as c:
                for _ in range(5):
                    assert c.get("/health").status_code == 200
                    r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
                    assert r.status_code == 200
        finally:
            for s in slow:
                s.close()
    wait_idle(llm)


def test_overload_is_always_the_documented_429(llm):
    """More concurrent requests than connections and admission slots: each one gets a 200 or
    the documented 429 (JSON, Retry-After), never uvicorn's plain-text 503."""
    import concurrent.futures

    limits = HTTPLimits(
        max_connections=6,
        max_connections_per_client=6,
        stall_s=5.0,
        new_connections_per_client_s=1e6,
    )
    saved = llm.max_pending
    llm.max_pending = 3
    try:
        with http_server(llm, limits=limits) as s:

            def one(i: int) -> tuple[int, str, str | None]:
                body = {"prompt": f"Story {i}:", "max_tokens": 24, "ignore_eos": True}
                with httpx.Client(base_url=s.url, timeout=120) as c:
                    r = c.post("/v1/completions", json=body)
                    return r.status_code, r.headers["content-type"], r.headers.get("retry-after")

            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                results = list(pool.map(one, range(16)))
    finally:
        llm.max_pending = saved
    assert {status for status, _, _ in results} <= {200, 429}, results
    assert any(status == 429 for status, _, _ in results)
    for status, ctype, retry in results:
        assert ctype == "application/json"
        assert status == 200 or retry == "1"
    wait_idle(llm)


def test_default_limits_agree():
    """The admission queue (429) fills before the connection cap; a --max-pending above the
    cap is refused at start-up."""
    from engine.cli.main import main

    assert main(["serve", "--max-pending", "4096", "--max-connections", "2048"]) == 2
    assert main(["rpc", "--max-pending", "10", "--max-inflight", "5"]) == 2


def test_connection_rate_per_client_is_bounded(llm):
    """A client address at its cap that opens connections faster than the rate (past a burst)
    has them reset at once: an attacker reconnecting as fast as it is closed costs little."""
    limits = HTTPLimits(
        max_connections=4, max_connections_per_client=2, new_connections_per_client_s=2.0
    )
    with http_server(llm, limits=limits) as s:
        socks = [_connect(s.url) for _ in range(6)]  # 2 under the cap, 4 from the burst
        extra = _connect(s.url)
        try:
            extra.settimeout(10)
            with pytest.raises((ConnectionResetError, BrokenPipeError)):
                extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert extra.recv(100) == b""  # reset: no answer
                raise ConnectionResetError
        finally:
            extra.close()
            for sock in socks:
                sock.close()
        time.sleep(1.0)  # the bucket refills
        metrics = httpx.get(s.url + "/metrics").text
        assert 'reason="connection_rate"} 1.0' in metrics


def test_connections_per_client_follow_the_request_cap():
    """`engine serve`: one address holds twice its request cap in connections (at least 64, at
    most half of all), so a reconnecting slowloris client is reset early instead of parsed."""
    from engine.cli.serve import connections_per_client

    assert connections_per_client(2048, 32) == 64
    assert connections_per_client(2048, 100) == 200
    assert connections_per_client(2048, 4096) == 1024
    assert connections_per_client(2048, 0) == 1024  # the request cap is off
    assert connections_per_client(100, 32) == 50
