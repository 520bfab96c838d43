"""POST /v1/responses with the official ``openai`` client and the default model: text and items
give what /v1/chat/completions gives for the same conversation, function tools through the
generic tool-call format, ``text.format`` json_schema (``responses.parse`` with a Pydantic model),
``previous_response_id`` (a continued conversation finds its prefix in the KV cache), the store
(``store: false``, GET, DELETE, eviction) and errors in OpenAI's shape."""

from __future__ import annotations

import json
import uuid

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from serverutil import http_server

from engine.config import CacheConfig
from engine.server.responses.store import ResponsesConfig

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": WEATHER,
    },
    {"type": "function", "name": "get_time", "description": "The current time in UTC"},
]
ASK = "What is the weather in Paris?"


class Capital(BaseModel):
    city: str = Field(max_length=16)
    country: str = Field(max_length=16)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _create(client, **kwargs):
    return client.responses.create(model="default", **({"temperature": 0} | kwargs))


def _chat_text(client, messages, max_tokens: int) -> tuple[str, int]:
    r = client.chat.completions.create(
        model="default", messages=messages, temperature=0, max_tokens=max_tokens
    )
    return r.choices[0].message.content, r.usage.prompt_tokens


def test_text_is_the_chat_reply(client):
    """instructions + a string input render as a system and a user message: the greedy reply
    and the prompt's length are chat's."""
    r = _create(
        client,
        instructions="Answer in one short sentence.",
        input="What is the capital of France?",
        max_output_tokens=24,
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete") and r.model == "default"
    assert [o.type for o in r.output] == ["message"]
    msg = r.output[0]
    assert msg.role == "assistant" and msg.id.startswith("msg_") and msg.status == r.status
    assert r.output_text == msg.content[0].text and r.output_text
    messages = [
        {"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    assert _chat_text(client, messages, 24) == (r.output_text, r.usage.input_tokens)
    u = r.usage
    assert u.total_tokens == u.input_tokens + u.output_tokens and 0 < u.output_tokens <= 24
    assert r.instructions == "Answer in one short sentence." and r.max_output_tokens == 24
    assert r.temperature == 0 and r.store is True and r.text.format.type == "text"


def test_items_are_the_chat_conversation(client):
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Blue.", "annotations": []}],
        },
        {"role": "user", "content": "Another one?"},
    ]
    r = _create(client, input=items, max_output_tokens=12)
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ]
    assert _chat_text(client, messages, 12) == (r.output_text, r.usage.input_tokens)


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "name": "get_weather"}], ids=["required", "named"]
)
def test_forced_call_and_its_output(client, choice):
    r = _create(
        client,
        input=ASK,
        tools=TOOLS,
        tool_choice=choice,
        parallel_tool_calls=False,
        max_output_tokens=40,
    )
    assert r.status == "completed" and r.parallel_tool_calls is False
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == len(r.output) == 1
    for call in calls:
        assert call.id.startswith("fc_") and call.call_id.startswith("call_")
        assert call.status == "completed"
        schema = WEATHER if call.name == "get_weather" else {"type": "object"}
        jsonschema.validate(json.loads(call.arguments), schema)
    if isinstance(choice, dict):
        assert {c.name for c in calls} == {"get_weather"}
    assert [t.name for t in r.tools] == ["get_weather", "get_time"]
    # The round trip: the calls go back with their outputs, and the model answers in text.
    items = [{"role": "user", "content": ASK}]
    items += [c.model_dump(exclude_none=True) for c in calls]
    items += [
        {"type": "function_call_output", "call_id": c.call_id, "output": '{"temperature_c": 21}'}
        for c in calls
    ]
    final = _create(client, input=items, tools=TOOLS, tool_choice="none", max_output_tokens=4)
    assert [o.type for o in final.output] == ["message"] and final.output_text


def test_auto_is_a_call_or_text(client):
    r = _create(client, input=ASK, tools=TOOLS, temperature=1, max_output_tokens=40)
    kinds = {o.type for o in r.output}
    assert kinds in ({"message"}, {"function_call"})
    assert r.tool_choice == "auto" and r.parallel_tool_calls is True


def test_json_schema_and_parse(client):
    schema = Capital.model_json_schema()
    r = _create(
        client,
        input="Name a European capital and its country as JSON.",
        text={"format": {"type": "json_schema", "name": "capital", "schema": schema}},
        max_output_tokens=64,
    )
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)
    parsed = client.responses.parse(
        model="default",
        input="Name a European capital and its country as JSON.",
        text_format=Capital,
        temperature=0,
        max_output_tokens=64,
    )
    assert isinstance(parsed.output_parsed, Capital)
    assert parsed.output_parsed == Capital.model_validate_json(r.output_text)


def test_previous_response_id_finds_its_prefix_in_the_cache(client):
    """A continued conversation renders to the previous prompt, its reply and the new turn: every
    full KV block of the first prompt is found in the cache. Its reply equals the one for the
    whole conversation sent as items. Other instructions change the prompt's first block: then
    nothing is found."""
    block = CacheConfig().block_size
    tag = uuid.uuid4().hex  # a prompt no earlier test has cached
    instructions = f"Session {tag}. Answer in one short sentence."
    first = _create(
        client,
        instructions=instructions,
        input="What is the capital of France?",
        max_output_tokens=16,
    )
    assert first.usage.input_tokens_details.cached_tokens == 0
    second = _create(
        client,
        instructions=instructions,
        previous_response_id=first.id,
        input="And the capital of Italy?",
        max_output_tokens=16,
    )
    assert second.previous_response_id == first.id
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens // block * block > 0
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    history = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And the capital of Italy?"},
    ]
    whole = _create(
        client, instructions=instructions, input=history, max_output_tokens=16, store=False
    )
    assert whole.output_text == second.output_text
    assert whole.usage.input_tokens == second.usage.input_tokens
    other = _create(
        client,
        instructions=f"Other {uuid.uuid4().hex}.",
        previous_response_id=first.id,
        input="And the capital of Italy?",
        max_output_tokens=4,
    )
    assert other.usage.input_tokens_details.cached_tokens == 0


def test_store_false_get_and_delete(client):
    kept = _create(client, input="Hi", max_output_tokens=4)
    got = client.responses.retrieve(kept.id)
    assert got.model_dump() == kept.model_dump()
    gone = _create(client, input="Hi", max_output_tokens=4, store=False)
    assert gone.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    with pytest.raises(openai.BadRequestError) as info:
        _create(client, input="Hi", previous_response_id=gone.id, max_output_tokens=4)
    assert info.value.body["param"] == "previous_response_id"
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(kept.id)


def test_the_store_evicts_the_oldest(llm):
    with (
        http_server(llm, responses=ResponsesConfig(store_size=2)) as s,
        httpx.Client(base_url=s.url, timeout=120) as http,
    ):
        ids = []
        for _ in range(3):
            r = http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2})
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
        assert [http.get(f"/v1/responses/{i}").status_code for i in ids] == [404, 200, 200]


@pytest.mark.parametrize(
    "body, status, param, words",
    [
        ({"input": "x", "colour": "red"}, 400, "colour", "colour is not a field"),
        ({"input": "x", "reasoning": {"effort": "low"}}, 400, "reasoning", "not supported"),
        ({"input": 3}, 400, "input", "input must be one of these types"),
        ({"input": [{"type": "reasoning"}]}, 400, "input", "input.0.type 'reasoning'"),
        ({"input": "x", "model": "gpt-5"}, 404, "model", "gpt-5"),
        ({"input": "x", "temperature": -1}, 400, "temperature", "temperature"),
        ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens", ">= 1"),
        ({"input": "x" * 200_000}, 400, "input", "too long"),
        ({"input": "x", "tool_choice": "required"}, 400, "tool_choice", "requires tools"),
        (
            {"input": "x", "tools": [{"type": "function", "name": "bad name"}]},
            400,
            "tools",
            "tools.0.name must be 1 to 64",
        ),
        (
            {
                "input": "x",
                "text": {
                    "format": {
                        "type": "json_schema",
                        "name": "n",
                        "schema": {
                            "type": "object",
                            "properties": {"a": {"type": "string", "pattern": "("}},
                        },
                    }
                },
            },
            400,
            "text",
            "text.format.schema",
        ),  # fmt: skip
        (
            {"input": "x", "tools": TOOLS, "text": {"format": {"type": "json_object"}}},
            400,
            "text",
            "cannot be combined",
        ),
    ],
)
def test_errors_name_the_field(http, body, status, param, words):
    r = http.post("/v1/responses", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and words in err["message"], err
    assert err["code"] == status


def test_a_forced_call_ignores_the_text_format(client):
    """With tool_choice required the reply is calls only: text.format shapes no text then (the
    Agents SDK sends both when an agent with an output type must call a tool)."""
    r = _create(
        client,
        input=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        text={"format": {"type": "json_object"}},
        max_output_tokens=64,
    )
    assert [o.type for o in r.output] == ["function_call"]


def test_unknown_ids_are_404s(http):
    for method in ("GET", "DELETE"):
        r = http.request(method, "/v1/responses/resp_nope")
        assert r.status_code == 404
        assert r.json()["error"]["param"] == "response_id"
