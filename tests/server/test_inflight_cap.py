"""The per-client cap on generation requests in flight (inflight_cap.py): a client at its cap gets
OpenAI's 429 with Retry-After, another address is not affected, /health and the other routes
are not counted, a finished or abandoned stream gives its place back, and the rejections are
counted in engine:request_rejected_total{reason="client_cap"}."""

from __future__ import annotations

import contextlib

import httpx
import pytest
from serverutil import http_server, wait_idle

from engine.cli.serve import DEFAULT_PER_CLIENT

LONG = {"prompt": "Count:", "max_tokens": 400, "ignore_eos": True, "stream": True}
SHORT = {"prompt": "Hi", "max_tokens": 1}


@pytest.fixture(scope="module")
def capped(llm):
    with http_server(llm, max_pending_per_client=2) as s:
        yield s


@contextlib.contextmanager
def streaming(client: httpx.Client):
    """A long streamed completion, open until the block ends (then the client disconnects)."""
    with client.stream("POST", "/v1/completions", json=LONG) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: a discarded line iterator closes the response
        next(lines)  # admitted and running
        yield


def test_a_client_at_its_cap_gets_429_and_others_do_not(capped, llm):
    other = httpx.HTTPTransport(local_address="127.0.0.2")
    with (
        httpx.Client(base_url=capped.url, timeout=60) as a,
        httpx.Client(base_url=capped.url, timeout=60, transport=other) as b,
    ):
        with streaming(a), streaming(a):
            r = a.post("/v1/completions", json=SHORT)
            assert r.status_code == 429
            assert r.headers["retry-after"] == "1"
            assert r.headers["content-type"] == "application/json"
            err = r.json()["error"]
            assert err["type"] == "RateLimitError" and "--max-pending-per-client" in err["message"]
            assert a.post("/v1/chat/completions", json={"messages": []}).status_code == 429
            assert a.post("/v1/responses", json={"input": "Hi"}).status_code == 429
            assert a.get("/v1/responses/resp_1").status_code == 404  # a stored one: not held
            # Other routes and other clients are not held back.
            assert a.get("/health").status_code == 200
            assert a.post("/tokenize", json={"prompt": "Hi"}).status_code == 200
            assert b.post("/v1/completions", json=SHORT).status_code == 200
        # The streams ended (the client went away): their places are free again.
        wait_idle(llm)
        assert a.post("/v1/completions", json=SHORT).status_code == 200
        metrics = a.get("/metrics").text
    line = next(x for x in metrics.splitlines() if 'reason="client_cap"' in x)
    assert float(line.split()[-1]) >= 2


def test_places_are_returned_after_errors(capped):
    with httpx.Client(base_url=capped.url, timeout=60) as c:
        bad = {"prompt": "Hi", "max_tokens": -1}
        for _ in range(5):  # more than the cap, one after another
            assert c.post("/v1/completions", json=bad).status_code == 400
        assert c.post("/v1/completions", json=SHORT).status_code == 200


def test_serve_default_and_off():
    import argparse

    from engine.cli.serve import check_limits

    def limits(**kw):
        args = argparse.Namespace(
            command="serve", max_connections=2048, max_pending=None, max_pending_per_client=None
        )
        vars(args).update(kw)
        check_limits(args)
        return args.max_pending_per_client

    assert limits() == DEFAULT_PER_CLIENT
    assert limits(max_pending=4) == 4  # never above the queue itself
    assert limits(max_pending_per_client=0) == 0  # off
    with pytest.raises(ValueError, match="--max-pending-per-client must be >= 0"):
        limits(max_pending_per_client=-1)
