"""An engine (or the cluster behind a router) that cannot serve a request raises EngineDeadError:
the client gets the OpenAI-shaped 503, and the server logs one line for it, not the
"Exception in ASGI application" traceback a catch-all handler leaves (a chaos run logged 137).
A request that passed the router's deadline is a 408, logged the same way."""

from __future__ import annotations

import logging

import httpx
import pytest
from serverutil import MODEL, http_server

from engine.async_llm import EngineDeadError
from engine.cluster.router.router import ClusterUnavailableError
from engine.core.metrics import MetricsSnapshot


class _Tokenizer:
    eos_token_ids: tuple[int, ...] = (0,)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def apply_chat_template(self, messages: list[dict], **kwargs) -> str:
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages)

    def decode(self, ids) -> str:
        return "".join(map(chr, ids))


class DeadEngine:
    """An EngineClient whose every request fails as a router's does when no worker can take it."""

    tokenizer = _Tokenizer()
    max_model_len = 256
    model_path = MODEL

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    async def generate(self, prompt, params=None, request_id=None, cache_salt=None, priority=0):
        raise self.exc
        yield  # an async generator, as the real ones

    async def abort(self, request_id: str) -> None:
        pass

    def is_healthy(self) -> bool:
        return False

    async def health(self) -> None:
        raise self.exc

    async def shutdown(self, timeout: float = 30.0) -> None:
        pass

    def metrics(self) -> MetricsSnapshot:
        none = [(float("inf"), 0)]  # empty histograms
        return MetricsSnapshot(
            *(0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0), finished={}, rejected=0,
            ttft=none, ttft_sum=0.0, itl=none, itl_sum=0.0, e2e=none, e2e_sum=0.0,
            queue_time=none, queue_time_sum=0.0,
        )  # fmt: skip


def post_once(caplog, exc: BaseException, path: str) -> tuple[httpx.Response, str]:
    """One request to a server whose engine fails with exc: the response and the metrics after
    it. The server logged exc in one WARNING line, without a traceback."""
    body = {"model": MODEL, "max_tokens": 4}
    if path == "/v1/completions":
        body["prompt"] = [5, 6, 7]
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    with caplog.at_level(logging.WARNING), http_server(DeadEngine(exc)) as s:
        r = httpx.post(s.url + path, json=body, timeout=30)
        metrics = httpx.get(s.url + "/metrics", timeout=30).text
    tracebacks = [rec for rec in caplog.records if rec.exc_info or "Traceback" in rec.getMessage()]
    assert not tracebacks, [rec.getMessage() for rec in tracebacks]
    lines = [rec for rec in caplog.records if str(exc) in rec.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    return r, metrics


@pytest.mark.parametrize(
    "exc",
    [
        ClusterUnavailableError("request r: the KV staging area is full"),
        EngineDeadError("engine loop died: RuntimeError()"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_engine_dead_is_a_503_without_a_traceback(caplog, exc, path):
    r, metrics = post_once(caplog, exc, path)
    assert r.status_code == 503, r.text
    # Counted as what it is: not a shutdown (the server is not draining).
    counted = 'engine:request_rejected_total{model_name="%s",reason="%s"} %s'
    assert counted % (MODEL, "unavailable", "1.0") in metrics
    assert counted % (MODEL, "shutting_down", "0.0") in metrics
    err = r.json()["error"]
    assert err["type"] == "ServiceUnavailableError" and err["code"] == 503
    assert str(exc) in err["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_router_deadline_is_a_408_without_a_traceback(caplog, path):
    exc = TimeoutError("request r passed its deadline")  # what the router fails it with
    r, _ = post_once(caplog, exc, path)
    assert r.status_code == 408, r.text
    err = r.json()["error"]
    assert err["type"] == "TimeoutError" and str(exc) in err["message"]
