"""The /v1/responses body and its items, without a model: what is refused by name (unknown
fields, unsupported ones, item and part types this server does not take), what is accepted as
asking for nothing, and the items rendered as the chat messages the template gets."""

from __future__ import annotations

import pytest

from engine.server.errors import APIError
from engine.server.responses.protocol import (
    FunctionCallItem,
    MessageItem,
    ResponsesRequest,
    parse_items,
    parse_tool_choice,
    parse_tools,
)
from engine.server.responses.rendering import output_items, output_messages, to_messages
from engine.structured.tool_parsers import ParsedCall


def _checked(**fields) -> ResponsesRequest:
    body = ResponsesRequest.model_validate({"input": "hi", **fields})
    body.check_fields()
    return body


def _refused(fn, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args, **kwargs)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(
    "fields, param, words",
    [
        ({"frobnicate": 1}, "frobnicate", "frobnicate is not a field of /v1/responses"),
        ({"seed": 3}, "seed", "seed is not a field"),  # chat's, not the Responses API's
        ({"reasoning": {"effort": "low"}}, "reasoning", "reasoning is not supported"),
        ({"include": ["reasoning.encrypted_content"]}, "include", "include is not supported"),
        ({"background": True}, "background", "background is not supported"),
        ({"conversation": "conv_1"}, "conversation", "conversation is not supported"),
        ({"top_logprobs": 3}, "top_logprobs", "top_logprobs is not supported"),
        ({"service_tier": "flex"}, "service_tier", "service_tier is not supported"),
        ({"text": {"verbosity": "low"}}, "text", "text.verbosity is not supported"),
        ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be >= 1"),
        ({"stream_options": {"include_obfuscation": False}}, "stream_options", "requires stream"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", "the limit is 16"),
    ],
)
def test_fields_refused_by_name(fields, param, words):
    err = _refused(_checked, **fields)
    assert err.param == param and words in err.message


def test_values_that_ask_for_nothing_are_accepted():
    body = _checked(
        include=[],
        background=False,
        service_tier="auto",
        truncation="disabled",
        top_logprobs=0,
        store=False,
        metadata={"k": "v"},
        user="u",
        text={"format": {"type": "text"}},
        stream=True,
        stream_options={"include_obfuscation": False},
    )
    assert body.store is False and body.format.type == "text"


def test_items_of_every_supported_kind():
    items = parse_items(
        [
            {"role": "system", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {
                "type": "message",
                "id": "msg_1",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
            },
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": '{"a": 1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "two"}],
            },
            {"role": "developer", "content": "Answer now."},
        ]
    )
    msgs = [m.as_template_dict() for m in to_messages(items)]
    assert msgs == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {  # the text and the calls right after it: one assistant message, as a chat reply
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": {"a": 1}}},
            ],
        },
        {"role": "tool", "content": "one", "tool_call_id": "c1"},
        {"role": "tool", "content": "two", "tool_call_id": "c2"},
        {"role": "developer", "content": "Answer now."},
    ]


def test_a_string_input_is_one_user_message():
    assert parse_items("Hello") == [MessageItem(role="user", content="Hello")]


def test_a_call_after_a_user_message_is_its_own_assistant_message():
    items = [
        MessageItem(role="user", content="q"),
        FunctionCallItem(type="function_call", call_id="c", name="f", arguments="{}"),
    ]
    msgs = to_messages(items)
    assert [(m.role, m.content, len(m.tool_calls or ())) for m in msgs] == [
        ("user", "q", 0),
        ("assistant", None, 1),
    ]


@pytest.mark.parametrize(
    "item, words",
    [
        ({"type": "reasoning", "summary": []}, "input.0.type 'reasoning' is not supported"),
        ({"type": "item_reference", "id": "x"}, "input.0.type 'item_reference'"),
        (
            {"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]},
            "input.0.content.0.type 'input_image' is not supported",
        ),
        ({"role": "tool", "content": "x"}, "input.0.role"),
        ({"role": "user", "content": "x", "colour": "red"}, "input.0.colour is not a field"),
        ({"type": "function_call", "name": "f", "arguments": "{}"}, "input.0.call_id"),
        (
            {"type": "function_call_output", "call_id": "c", "output": [{"type": "output_text"}]},
            "input.0.output.0.type 'output_text' is not supported",
        ),
    ],
)
def test_items_refused_by_place(item, words):
    err = _refused(parse_items, [item])
    assert err.param == "input" and words in err.message, err.message


def test_tools_and_tool_choice():
    tools = parse_tools([{"type": "function", "name": "f", "parameters": {"type": "object"}}])
    assert tools[0].name == "f"
    err = _refused(parse_tools, [{"type": "web_search"}])
    assert "tools.0.type 'web_search' is not supported" in err.message
    err = _refused(parse_tools, [{"type": "function", "function": {"name": "f"}}])
    assert "tools.0.name" in err.message  # the chat shape is not this API's
    assert parse_tool_choice({"type": "function", "name": "f"}).name == "f"
    assert parse_tool_choice("required") == "required"
    err = _refused(parse_tool_choice, {"type": "allowed_tools", "mode": "auto", "tools": []})
    assert err.param == "tool_choice" and "'allowed_tools' is not supported" in err.message


def test_output_items_and_back():
    calls = [ParsedCall("f", '{"a": 1}')]
    out = output_items(None, calls, "completed")
    assert [o["type"] for o in out] == ["function_call"]
    assert out[0]["id"].startswith("fc_") and out[0]["call_id"].startswith("call_")
    text = output_items("Hi", [], "incomplete")
    assert text[0]["status"] == "incomplete" and text[0]["content"][0]["text"] == "Hi"
    assert output_items(None, [], "completed")[0]["content"][0]["text"] == ""  # empty reply
    msgs = output_messages(text + out)
    assert [m.as_template_dict() for m in msgs] == [
        {
            "role": "assistant",
            "content": "Hi",
            "tool_calls": [
                {
                    "id": out[0]["call_id"],
                    "type": "function",
                    "function": {"name": "f", "arguments": {"a": 1}},
                }
            ],
        }
    ]
