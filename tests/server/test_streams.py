"""Many concurrent streams, and a client that disconnects mid-stream."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from serverutil import wait_idle


async def _stream(client: httpx.AsyncClient, i: int, max_tokens: int) -> tuple[int, bool]:
    body = {
        "prompt": f"Request {i}: tell me a story about the number {i}.",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.7,
        "seed": i,
        "stream": True,
    }
    tokens, done = 0, False
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            tokens += (
                1 if chunk["choices"][0]["text"] or chunk["choices"][0]["finish_reason"] else 0
            )
    return tokens, done


def test_fifty_concurrent_streams_complete(server, llm):
    async def main():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(_stream(client, i, 6) for i in range(50)))

    before = llm.metrics().finished.get("length", 0)
    results = asyncio.run(main())
    assert all(done for _, done in results)
    assert all(n >= 1 for n, _ in results)
    assert llm.metrics().finished.get("length", 0) - before == 50
    wait_idle(llm)


def test_disconnect_mid_stream_frees_kv(server, llm, http):
    aborted = llm.metrics().finished.get("abort", 0)
    body = {"prompt": "Count to a thousand:", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [line for line, _ in zip(lines, range(6)) if line.startswith("data: {")]
            assert got
            assert llm.metrics().kv_usage > 0
        # leaving the block closes the connection while the server is still generating
    # The engine's gauges are read without stopping it: poll until both read idle.
    idle = (
        'engine:kv_cache_usage_perc{model_name="default"} 0.0',
        'engine:num_requests_running{model_name="default"} 0.0',
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        text = http.get("/metrics").text
        if all(line in text for line in idle):
            break
        time.sleep(0.1)
    assert all(line in text for line in idle), text[:800]
    assert llm.metrics().finished.get("abort", 0) == aborted + 1
    wait_idle(llm)
