"""Streamed /v1/responses: OpenAI's typed events in their order, numbered from 0 without a gap,
each on an ``event:`` line naming its type, that add up to the non-streamed response (text, a
function call, a JSON-schema reply), read raw and by the ``openai`` client's
``responses.stream``; a streamed response is stored and continued like a whole one."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel, Field

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
        },
    }
]
TEXT_EVENTS = [
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]
CALL_EVENTS = [
    "response.output_item.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
]


class Answer(BaseModel):
    answer: str = Field(max_length=24)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _events(http, body: dict) -> list[dict]:
    """The stream's events, each checked against its ``event:`` line."""
    events = []
    body = {"model": "default", "temperature": 0, "stream": True} | body
    with http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
                assert data["type"] == kind
                events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def _collapse(types: list[str]) -> list[str]:
    """Runs of one delta type as one."""
    out = []
    for t in types:
        if not (out and t == out[-1] and t.endswith(".delta")):
            out.append(t)
    return out


def test_text_events_in_order_add_up_to_the_whole_response(http):
    body = {"input": "Write a short greeting.", "max_output_tokens": 12}
    whole = http.post("/v1/responses", json={"model": "default", "temperature": 0} | body).json()
    events = _events(http, body)
    types = [e["type"] for e in events]
    last = "response.completed" if whole["status"] == "completed" else "response.incomplete"
    assert _collapse(types) == ["response.created", "response.in_progress", *TEXT_EVENTS, last]
    head = events[0]["response"]
    assert head["status"] == "in_progress" and head["output"] == []
    assert events[1]["response"]["id"] == head["id"]
    item_id = events[2]["item"]["id"]
    assert events[2]["item"]["status"] == "in_progress" and events[2]["item"]["content"] == []
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert all(
        (e["item_id"], e["output_index"], e["content_index"]) == (item_id, 0, 0) for e in deltas
    )
    text = "".join(e["delta"] for e in deltas)
    done = {e["type"]: e for e in events}
    assert done["response.output_text.done"]["text"] == text
    assert done["response.content_part.done"]["part"]["text"] == text
    final = events[-1]["response"]
    assert final["id"] == head["id"] and final["status"] == whole["status"]
    assert final["output"][0]["id"] == item_id
    assert final["output"][0]["content"][0]["text"] == text
    assert whole["output"][0]["content"][0]["text"] == text
    assert final["usage"]["output_tokens"] == whole["usage"]["output_tokens"]


def test_a_cut_reply_ends_with_response_incomplete(http):
    events = _events(http, {"input": "Tell me a long story.", "max_output_tokens": 3})
    assert events[-1]["type"] == "response.incomplete"
    final = events[-1]["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"


def test_a_call_streams_as_argument_events(http):
    body = {"input": "What is the weather in Paris?", "tools": TOOLS, "tool_choice": "required"}
    body["max_output_tokens"] = 40
    body["parallel_tool_calls"] = False
    whole = http.post("/v1/responses", json={"model": "default", "temperature": 0} | body).json()
    events = _events(http, body)
    types = [e["type"] for e in events]
    assert types == ["response.created", "response.in_progress", *CALL_EVENTS, "response.completed"]
    added, delta, done, item_done = events[2:6]
    assert added["item"]["type"] == "function_call" and added["item"]["arguments"] == ""
    assert added["item"]["status"] == "in_progress"
    item = item_done["item"]
    assert delta["delta"] == done["arguments"] == item["arguments"]
    assert done["name"] == item["name"] == "get_weather"
    assert added["item"]["call_id"] == item["call_id"] and added["item"]["id"] == item["id"]
    assert events[-1]["response"]["output"] == [item]
    assert [(o["name"], o["arguments"]) for o in whole["output"]] == [
        (item["name"], item["arguments"])
    ]


def test_the_openai_client_stream(client):
    kwargs = {"model": "default", "input": "Say hello.", "temperature": 0, "max_output_tokens": 64}
    whole = client.responses.create(**kwargs)
    assert whole.status == "completed"  # the helper's final response needs response.completed
    text = ""
    with client.responses.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                text += event.delta
        final = stream.get_final_response()
    assert final.output_text == text == whole.output_text
    # Stored like a whole response, and continued the same way.
    assert client.responses.retrieve(final.id).output_text == text
    more = client.responses.create(
        model="default",
        previous_response_id=final.id,
        input="Again.",
        temperature=0,
        max_output_tokens=4,
    )
    assert more.usage.input_tokens_details.cached_tokens > 0


def test_the_openai_client_stream_with_a_text_format(client):
    with client.responses.stream(
        model="default",
        input="Answer as JSON: what colour is the sky?",
        text_format=Answer,
        temperature=0,
        max_output_tokens=48,
    ) as stream:
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Answer)
