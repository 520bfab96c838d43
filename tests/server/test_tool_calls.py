"""OpenAI tools on /v1/chat/completions, with the official ``openai`` client and the default model
(its template has no tools section: the generic format, docs/tool_calls.md): calls forced by
tool_choice "required" and a named function, "auto" answered with a call or text, the round trip
with the assistant's tool_calls and the tool's result sent back, streamed as non-streamed."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from serverutil import http_server

from engine.server.tool_calls import ToolCallStream
from engine.structured.tool_parsers import GenericParser, HermesParser, ParsedCall

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The current time in UTC"},
    },
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters") for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ASK_TWO = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]
MAX_TOKENS = 64  # a call to get_weather is about 30 tokens
SHORT = 40  # "auto": enough for a call, or the start of a text


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _check_call(call) -> None:
    assert call.type == "function"
    assert call.id.startswith("call_")
    schema = SCHEMAS[call.function.name]
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema or {"type": "object", "properties": {}})


def _chat(client, messages, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": MAX_TOKENS, "tools": TOOLS} | kwargs
    return client.chat.completions.create(model="default", messages=messages, **kwargs)


def _streamed(client, messages, **kwargs) -> tuple[str | None, list[dict], str]:
    """content, calls (name and arguments) and finish_reason, accumulated from the deltas, here
    and by the ``openai`` client's own accumulator (which must agree)."""
    content, calls, reason = None, {}, None
    state = ChatCompletionStreamState(input_tools=TOOLS)
    for chunk in _chat(client, messages, stream=True, **kwargs):
        state.handle_chunk(chunk)
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content = (content or "") + delta.content
            for tc in delta.tool_calls or ():
                entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = entry["id"] or tc.id
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            reason = choice.finish_reason or reason
    assert all(c["id"].startswith("call_") for c in calls.values())
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == reason
    ours = [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())]
    theirs = [(c.id, c.function.name, c.function.arguments) for c in final.message.tool_calls or ()]
    assert theirs == ours
    assert final.message.content == content
    return (
        content,
        [{k: c[k] for k in ("name", "arguments")} for _, c in sorted(calls.items())],
        reason,
    )


def _whole(msg) -> tuple[str | None, list[dict]]:
    calls = [
        {"name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls or ()
    ]
    return msg.content, calls


@pytest.mark.parametrize(
    "choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_forced_call_round_trip(client, choice):
    r = _chat(client, ASK, tool_choice=choice)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content is None
    assert c.message.tool_calls
    for call in c.message.tool_calls:
        _check_call(call)
    if isinstance(choice, dict):
        assert {call.function.name for call in c.message.tool_calls} == {"get_weather"}
    # The round trip: the assistant's calls and each call's result go back.
    history = ASK + [c.message.model_dump(exclude_none=True)]
    history += [
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}
        for call in c.message.tool_calls
    ]
    final = _chat(client, history, tool_choice="none", max_tokens=8).choices[0]
    assert final.message.tool_calls is None
    assert isinstance(final.message.content, str) and final.message.content
    # With tools still offered, "auto": a valid call or plain text.
    again = _chat(client, history, tool_choice="auto", max_tokens=SHORT).choices[0]
    _check_auto(again)


def _check_auto(c) -> None:
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls"
        for call in c.message.tool_calls:
            _check_call(call)
    else:
        assert isinstance(c.message.content, str)
        assert c.finish_reason in ("stop", "length")


def test_auto_is_a_call_or_text(client):
    _check_auto(_chat(client, ASK, temperature=1, seed=1, max_tokens=SHORT).choices[0])
    # auto is the default when tools are given
    _check_auto(_chat(client, ASK, temperature=1, seed=2, max_tokens=SHORT).choices[0])


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_streamed_equals_whole(client, choice):
    kwargs = {"tool_choice": choice, "seed": 7, "max_tokens": SHORT}
    whole = _chat(client, ASK, **kwargs).choices[0]
    content, calls, reason = _streamed(client, ASK, **kwargs)
    assert (content, calls) == _whole(whole.message)
    assert reason == whole.finish_reason


def test_parallel_tool_calls_false_makes_one_call(client):
    """Asked for two cities, with parallel calls off: one call, whole or streamed."""
    kwargs = {"tool_choice": "required", "parallel_tool_calls": False}
    calls = _chat(client, ASK_TWO, temperature=1, seed=1, **kwargs).choices[0].message.tool_calls
    assert len(calls) == 1
    _check_call(calls[0])
    _, calls, reason = _streamed(client, ASK_TWO, **kwargs)
    assert len(calls) == 1 and reason == "tool_calls"


def test_tool_choice_none_makes_no_call(client):
    r = _chat(client, ASK, tool_choice="none", max_tokens=8)
    assert r.choices[0].message.tool_calls is None
    assert isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_hermes_format_forced_on_the_default_model(llm):
    """--tool-call-parser hermes: a forced call is written and read in Qwen's <tool_call> format
    (the default model's template ignores the tools, but the grammar makes the call)."""
    with http_server(llm, tool_call_parser="hermes") as s:
        hermes = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        # <tool_call> is 5 tokens of this vocabulary (one in Qwen's): room for two of them.
        kwargs = {"tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 96}
        r = _chat(hermes, ASK, **kwargs)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", repr(c.message.content)
        assert len(c.message.tool_calls) == 1
        _check_call(c.message.tool_calls[0])
        content, calls, reason = _streamed(hermes, ASK, **kwargs)
        assert (content, calls, reason) == (*_whole(c.message), "tool_calls")


def test_tool_history_renders_without_tools(client, http):
    """A conversation holding calls and results needs no tools in the request (and /tokenize
    takes it too)."""
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    r = client.chat.completions.create(model="default", messages=history, max_tokens=4)
    assert isinstance(r.choices[0].message.content, str)
    assert http.post("/tokenize", json={"messages": history}).status_code == 200


_TOOL = TOOLS[0]


@pytest.mark.parametrize(
    "extra, param, words",
    [
        (
            {"tools": [_TOOL], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "not in tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "requires tools"),
        ({"tools": [_TOOL, _TOOL]}, "tools", "twice"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "letters"),
        ({"tools": [_TOOL] * 129}, "tools", "limit is 128"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"type": "nonsense"}},
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
            "tools.0.function.parameters",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ]
            },
            "tools",
            "tools.0.function.parameters must be the JSON schema of an object",
        ),
        ({"messages": [{"role": "tool", "content": "1"}]}, "messages", "tool_call_id"),
        (
            {"messages": [{"role": "user", "content": "1", "tool_call_id": "c"}]},
            "messages",
            "tool_call_id",
        ),
        (
            {"messages": [{"role": "user", "content": "1", "tool_calls": []}]},
            "messages",
            "tool_calls",
        ),
        (
            {
                "tools": [_TOOL],
                "tool_choice": "required",
                "structured_outputs": {"json": {"type": "object"}},
            },
            None,
            None,
        ),
        ({"functions": [{"name": "f"}]}, "functions", "not supported"),
        ({"function_call": "auto"}, "function_call", "not supported"),
    ],
)
def test_bad_tool_requests_are_400(http, extra, param, words):
    body = {"messages": ASK, "max_tokens": 2} | extra
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if param is not None:
        assert err["param"] == param, err
        assert words in err["message"], err


def _feed(stream: ToolCallStream, pieces: list[str]) -> tuple[list[str], list[ParsedCall]]:
    sent = [stream.feed(p, False)[0] for p in pieces[:-1]]
    last, calls = stream.feed(pieces[-1], True)
    return [*sent, last], calls


def test_stream_holds_back_what_may_be_a_call():
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    weather = ParsedCall("get_weather", '{"city": "Paris"}')
    pieces = ["Let me ", "check.\n", "<tool", "_call>\n" + call[:20], call[20:] + "\n</tool_call>"]
    sent, calls = _feed(ToolCallStream(HermesParser(), True), pieces)
    assert sent == ["Let me", " check.", "", "", ""] and calls == [weather]
    # Text that only looked like the start of a tag goes out once it is not one.
    sent, calls = _feed(ToolCallStream(HermesParser(), True), ["a <tool", "s> b"])
    assert sent == ["a", " <tools> b"] and calls == []
    generic = '{"tool_calls": [' + call + ", " + call + "]}"
    sent, calls = _feed(ToolCallStream(GenericParser(), False), [generic[:9], generic[9:]])
    assert sent == ["", ""] and calls == [weather]  # parallel calls off: the first only
    sent, calls = _feed(ToolCallStream(GenericParser(), True), ["Sun", "ny."])
    assert sent == ["Sun", "ny."] and calls == []
    # A call cut short (max_tokens) is not a call: the held text goes out as content.
    sent, calls = _feed(ToolCallStream(GenericParser(), True), ['{"tool_', 'calls": ['])
    assert sent == ["", '{"tool_calls": ['] and calls == []
