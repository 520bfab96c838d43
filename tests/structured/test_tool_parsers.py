"""Each tool-call parser on literal replies: calls, content, replies that only look like calls,
and how much of a partial reply a stream may send as content."""

from __future__ import annotations

import json

import pytest

from engine.structured.tool_parsers import (
    GenericParser,
    HermesParser,
    Llama3JSONParser,
    ParsedCall,
    get_parser,
)

WEATHER = ParsedCall("get_weather", json.dumps({"city": "Paris"}))


def test_generic():
    p = GenericParser()
    text = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'
    assert p.parse(text) == (None, [WEATHER])
    two = '{"tool_calls":[{"name":"a","arguments":{}},{"name":"b","arguments":{"x":[1]}}]}'
    assert p.parse(two) == (None, [ParsedCall("a", "{}"), ParsedCall("b", '{"x": [1]}')])
    assert p.parse("It is sunny.") == ("It is sunny.", [])
    assert p.parse("") == (None, [])
    for not_a_call in ('{"tool_calls": [{"name": "a"', '{"answer": 1}', '{"tool_calls": []}'):
        assert p.parse(not_a_call) == (not_a_call, [])


def test_hermes():
    p = HermesParser()
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert p.parse(call) == (None, [WEATHER])
    assert p.parse("Let me look.\n\n" + call + "\n" + call) == ("Let me look.", [WEATHER] * 2)
    # The last block may lack its end tag (the reply stopped on an end-of-turn token).
    assert p.parse(call.removesuffix("</tool_call>")) == (None, [WEATHER])
    # Arguments written as a JSON string are read too.
    quoted = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}'
    assert p.parse(quoted) == (None, [WEATHER])
    assert p.parse("Sunny.") == ("Sunny.", [])
    bad = "Hi <tool_call>{not json}</tool_call>"
    assert p.parse(bad) == (bad, [])


def test_llama3_json():
    p = Llama3JSONParser()
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert p.parse(call) == (None, [WEATHER])
    assert p.parse("<|python_tag|>" + call) == (None, [WEATHER])
    assert p.parse(call + "; " + call) == (None, [WEATHER] * 2)
    assert p.parse('{"name": "get_weather", "arguments": {"city": "Paris"}}') == (None, [WEATHER])
    assert p.parse("Sunny.") == ("Sunny.", [])
    for not_a_call in (call + " and more", '{"name": 1, "parameters": {}}', call[:-3]):
        assert p.parse(not_a_call) == (not_a_call, [])


@pytest.mark.parametrize(
    "parser, text, end",
    [
        (GenericParser(), "", 0),
        (GenericParser(), '{"tool_', 0),
        (GenericParser(), "Sunny", 5),
        (Llama3JSONParser(), "<|python", 0),
        (Llama3JSONParser(), ' {"na', 0),
        (Llama3JSONParser(), "Sunny", 5),
        (HermesParser(), "Sunny", 5),
        (HermesParser(), "Sunny \n", 5),  # whitespace waits for what follows it
        (HermesParser(), "Sunny <tool", 5),  # the start of a tag waits
        (HermesParser(), "Sunny <tool_call>{", 5),
        (HermesParser(), "a < b", 5),
    ],
)
def test_content_end(parser, text, end):
    assert parser.content_end(text) == end


def test_get_parser():
    assert isinstance(get_parser("hermes"), HermesParser)
    with pytest.raises(ValueError, match="unknown .*known: generic, hermes, llama3_json"):
        get_parser("mistral")
