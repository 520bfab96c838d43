"""The peer benchmarks' streamed request (engine/bench/servers.py): the first text's time, the
usage's token count (the chunks with text without it) and the text, from an OpenAI stream."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from engine.bench.servers import stream_completion


def stream(with_usage: bool):
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert (body["max_tokens"], body["ignore_eos"], body["stream"]) == (5, False, True)
        events = [{"choices": [{"text": "ab"}]}, {"choices": [{"text": ""}]}]
        events += [{"choices": [{"text": "c"}]}]
        if with_usage:
            events.append({"choices": [], "usage": {"completion_tokens": 4}})
        lines = [f"data: {json.dumps(e)}" for e in events] + ["data: [DONE]"]
        return httpx.Response(200, content="\n\n".join(lines).encode())

    return handler


@pytest.mark.parametrize("with_usage", [True, False])
def test_a_streamed_completion_is_timed_counted_and_read(with_usage):
    async def main():
        transport = httpx.MockTransport(stream(with_usage))
        async with httpx.AsyncClient(transport=transport, base_url="http://peer") as client:
            return await stream_completion(client, "m", [1, 2], 5, ignore_eos=False)

    r = asyncio.run(main())
    assert r["text"] == "abc" and r["out"] == (4 if with_usage else 2)
    assert 0 < r["ttft"] <= r["e2e"]


def test_an_error_status_is_raised():
    async def main():
        transport = httpx.MockTransport(lambda _: httpx.Response(503, content=b"busy"))
        async with httpx.AsyncClient(transport=transport, base_url="http://peer") as client:
            await stream_completion(client, "m", [1], 5, ignore_eos=True)

    with pytest.raises(RuntimeError, match="HTTP 503"):
        asyncio.run(main())
