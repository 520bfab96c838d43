"""How a request ends, as a client of the HTTP and the RPC server sees it (docs/endings.md): a
200 (or an RPC result, a stream's last chunk) carries the whole answer with a true finish
reason; a request whose outputs stop before a final one, that ends with a finish reason of the
engine's own, that its engine loses mid-way, or (a whole response) that the server's shutdown
aborted, ends with a 503 naming why: an error reply, or in a stream an error event, never a
quiet end that reads as complete.

The engine is scripted (an EngineClient that yields the outputs given, then stops), so each
ending is exact and fast."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from serverutil import MODEL, RPCThread, http_server
from test_engine_dead import DeadEngine

from engine.async_llm import EngineDeadError
from engine.outputs import CompletionOutput, RequestOutput

PROMPT = [5, 6, 7]


def output(text: str, done: str | None, new: str, why: str | None = None) -> RequestOutput:
    """A one-choice output holding ``text`` so far (``new`` of it this step), ended by ``done``
    (with stop reason ``why``)."""
    ids = [ord(ch) for ch in text]
    c = CompletionOutput(0, text, ids, finish_reason=done, stop_reason=why, new_text=new)
    c.new_token_ids = ids[len(ids) - len(new) :]
    return RequestOutput("r", None, PROMPT, [c], finished=done is not None)


# Each ending: what the engine hands the server after the first output "He".
ENDINGS = {
    "stop": [output("Hello", "stop", "llo")],
    "length": [output("Hello", "length", "llo")],
    "cut short": [],  # the outputs stop without a final one
    "handed_over": [output("Hello", "handed_over", "llo")],
    "stage_done": [output("He", "stage_done", "")],
    "error": [output("Hello", "error", "llo")],
    "grammar refused": [output("Hel", "error", "l", "grammar_refused")],  # output_processor.py
    "engine died": [EngineDeadError("engine loop died: RuntimeError('boom')")],
    "abort": [output("Hel", "abort", "l")],  # the server's shutdown aborted it
}
ANSWERS = ("stop", "length")  # the endings that are a whole answer
WHY = {  # what the error names
    "cut short": "ended without its final output",
    "handed_over": "'handed_over', not an answer",
    "stage_done": "'stage_done', not an answer",
    "error": "'error', not an answer",
    "grammar refused": "'error' (grammar_refused), not an answer",
    "engine died": "engine loop died",
    "abort": "was aborted before its answer was complete",
}


class ScriptedEngine(DeadEngine):
    """Every request yields "He" and then the ending's outputs (an exception is raised)."""

    def __init__(self, ending: str) -> None:
        super().__init__(RuntimeError("unused"))
        self.script = [output("He", None, "He"), *ENDINGS[ending]]
        self.aborted: list[str] = []

    async def generate(self, prompt, params=None, request_id=None, cache_salt=None, priority=0):
        for item in self.script:
            if isinstance(item, BaseException):
                raise item
            yield item

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def is_healthy(self) -> bool:
        return True

    async def health(self) -> None:
        pass


def sse_events(text: str) -> list:
    return [
        json.loads(line[6:]) if line != "data: [DONE]" else "[DONE]"
        for line in text.splitlines()
        if line.startswith("data: ")
    ]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("ending", list(ENDINGS))
def test_http_whole_response(ending, path):
    body = {"model": MODEL, "max_tokens": 8}
    if path == "/v1/completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    with http_server(ScriptedEngine(ending)) as s:
        r = httpx.post(s.url + path, json=body, timeout=30)
    if ending in ANSWERS:
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == ending
        assert (choice.get("text") or choice["message"]["content"]) == "Hello"
        return
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == 503 and WHY[ending] in err["message"]


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_http_stream(ending):
    body = {"model": MODEL, "max_tokens": 8, "prompt": PROMPT, "stream": True}
    with http_server(ScriptedEngine(ending)) as s:
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text  # the headers went out with the first output
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if "choices" in e]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    errors = [e["error"] for e in events[:-1] if "error" in e]
    if ending in ANSWERS or ending == "abort":  # "abort": documented (docs/serving.md)
        assert not errors and reasons[-1] == ending, events
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert text == ("Hello" if ending != "abort" else "Hel")
        return
    # Not an answer: an error event before [DONE], and no chunk with a finish reason.
    assert len(errors) == 1 and errors[0]["code"] == 503, events
    assert WHY[ending] in errors[0]["message"]
    assert reasons == [None], events
    assert events[-2] == {"error": errors[0]}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_rpc(ending):
    from engine.client import RPCClient, RPCError

    with RPCThread(ScriptedEngine(ending)) as server, RPCClient(server.address) as client:
        if ending in ANSWERS:
            result = client.generate(PROMPT, max_tokens=8, timeout=30)
            assert result.outputs[0].finish_reason == ending and result.text == "Hello"
            deltas = list(client.stream(PROMPT, max_tokens=8, timeout=30))
            assert deltas[-1].outputs[0].finish_reason == ending
            assert "".join(d.text for d in deltas) == "Hello"
            return
        with pytest.raises(RPCError) as whole:
            client.generate(PROMPT, max_tokens=8, timeout=30)
        assert whole.value.code == 503 and WHY[ending] in whole.value.message
        deltas = []
        if ending == "abort":  # a stream ends on its "abort" chunk (docs/serving.md)
            deltas = list(client.stream(PROMPT, max_tokens=8, timeout=30))
            assert deltas[-1].outputs[0].finish_reason == "abort"
            return
        with pytest.raises(RPCError) as streamed:
            for delta in client.stream(PROMPT, max_tokens=8, timeout=30):
                deltas.append(delta)
        assert streamed.value.code == 503 and WHY[ending] in streamed.value.message
        assert [c.finish_reason for d in deltas for c in d.outputs] == [None]


def test_rpc_whole_result_aborted_by_its_client_is_its_answer():
    """An abort the client asked for (the abort op) is the answer it gets: finish_reason
    "abort", not an error."""
    from engine.client import AsyncRPCClient

    engine = ScriptedEngine("abort")
    first, aborted = engine.script

    async def generate(prompt, params=None, request_id=None, cache_salt=None, priority=0):
        yield first
        while not engine.aborted:
            await asyncio.sleep(0.01)
        yield aborted

    engine.generate = generate

    async def main(address):
        async with AsyncRPCClient(address) as client:
            call = asyncio.ensure_future(
                client.generate(PROMPT, max_tokens=8, request_id="mine", timeout=30)
            )
            while not await client.abort("mine"):
                await asyncio.sleep(0.01)
            return await call

    with RPCThread(engine) as server:
        result = asyncio.run(main(server.address))
    assert result.outputs[0].finish_reason == "abort" and result.text == "Hel"


def test_http_whole_response_cut_by_the_shutdown_deadline_is_a_503():
    """End to end on a real (tiny) engine: the shutdown's deadline aborts a request that is not
    streamed; its client gets a 503 naming the abort, not a 200 with part of the answer."""
    import threading
    import time

    from tiny_models import tiny_model

    from engine.async_llm import AsyncLLM
    from engine.config import CacheConfig, EngineConfig

    config = EngineConfig(
        model=str(tiny_model("llama")), dtype="float32", device="cpu", max_model_len=4096,
        cache=CacheConfig(num_blocks=512),
    )  # fmt: skip
    llm = AsyncLLM(config=config)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True}
    got: list[httpx.Response] = []
    try:
        with http_server(llm) as s:
            post = threading.Thread(
                target=lambda: got.append(
                    httpx.post(s.url + "/v1/completions", json=body, timeout=60)
                ),  # fmt: skip
            )
            post.start()
            deadline = time.monotonic() + 30
            while llm.metrics().generation_tokens < 2:
                assert time.monotonic() < deadline and post.is_alive(), got
                time.sleep(0.01)
            llm.set_deadline(time.monotonic())  # what the drain does when its time is up
            post.join(60)
    finally:
        llm.close()
    (r,) = got
    assert r.status_code == 503, r.text
    assert "was aborted before its answer was complete" in r.json()["error"]["message"]


def two_choices(a: tuple, b: tuple, finished: bool) -> RequestOutput:
    """n=2: each choice (text, finish_reason, new text)."""
    cs = []
    for i, (text, done, new) in enumerate((a, b)):
        c = output(text, done, new).outputs[0]
        c.index = i
        cs.append(c)
    return RequestOutput("r", None, PROMPT, cs, finished=finished)


def test_n2_one_choice_ends_early_each_ends_with_its_own_reason_once():
    """A choice that ends before the other carries its own finish reason in its last chunk,
    once (the engine's later outputs hold it again, finished, with nothing new; before the
    fix every one was streamed as another chunk with its finish reason), HTTP and RPC; the
    stream goes on for the other, and a whole response holds both, each with its reason."""
    engine = ScriptedEngine("stop")
    engine.script = [
        two_choices(("A", None, "A"), ("B", None, "B"), False),
        two_choices(("A.", "stop", "."), ("BB", None, "B"), False),
        two_choices(("A.", "stop", ""), ("BBB", "length", "B"), True),
    ]
    body = {"model": MODEL, "max_tokens": 3, "prompt": PROMPT, "n": 2}
    with http_server(engine) as s:
        whole = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
        streamed = httpx.post(s.url + "/v1/completions", json={**body, "stream": True}, timeout=30)
    assert whole.status_code == 200, whole.text
    got = [(c["text"], c["finish_reason"]) for c in whole.json()["choices"]]
    assert got == [("A.", "stop"), ("BBB", "length")]
    events = sse_events(streamed.text)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    ends = [
        (c["index"], c["finish_reason"])
        for e in events[:-1]
        for c in e["choices"]
        if c["finish_reason"] is not None
    ]
    assert ends == [(0, "stop"), (1, "length")]
    from engine.client import RPCClient

    with RPCThread(engine) as server, RPCClient(server.address) as client:
        deltas = list(client.stream(PROMPT, max_tokens=3, n=2, timeout=30))
    ends = [(c.index, c.finish_reason) for d in deltas for c in d.outputs if c.finish_reason]
    assert ends == [(0, "stop"), (1, "length")]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("ending", ["cut short", "handed_over"])
def test_responses_api_refuses_what_is_no_answer(ending, stream):
    """/v1/responses reads the same checked outputs: a 503 naming why, or when streamed an
    error event and response.failed, never a completed response."""
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 8, "stream": stream}
    with http_server(ScriptedEngine(ending)) as s:
        r = httpx.post(s.url + "/v1/responses", json=body, timeout=30)
    if not stream:
        assert r.status_code == 503, r.text
        assert WHY[ending] in r.json()["error"]["message"]
        return
    events = [e for e in sse_events(r.text) if e != "[DONE]"]
    kinds = [e.get("type") for e in events]
    assert "response.completed" not in kinds and kinds[-2:] == ["error", "response.failed"]
    assert WHY[ending] in events[-2]["message"]
