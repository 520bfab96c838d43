"""The structured-output fields of a request body (engine/server/openai_structured.py) mapped to
one StructuredOutputs, and the 400s naming the field the client sent. No server, no model."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from engine.server.errors import APIError
from engine.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from engine.server.openai_structured import in_field
from engine.structured.params import MAX_SCHEMA_DEPTH, StructuredOutputs

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "Hi"}], **fields}
    return ChatCompletionRequest.model_validate_json(json.dumps(body))


def constraint(**fields):
    return chat(**fields).structured_outputs_constraint()


def refused(**fields) -> APIError:
    with pytest.raises(APIError) as info:
        constraint(**fields)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(
    "fields, expected, field",
    [
        ({}, None, None),
        ({"response_format": {"type": "text"}}, None, None),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}, "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            {"json": SCHEMA},
            "response_format",
        ),
        ({"structured_outputs": {"json": SCHEMA}}, {"json": SCHEMA}, "structured_outputs"),
        (
            {"structured_outputs": {"json": json.dumps(SCHEMA)}},
            {"json": SCHEMA},
            "structured_outputs",
        ),
        ({"structured_outputs": {"regex": "a+"}}, {"regex": "a+"}, "structured_outputs"),
        (
            {"structured_outputs": {"choice": ["x", "y"]}},
            {"choice": ["x", "y"]},
            "structured_outputs",
        ),
        (
            {"structured_outputs": {"grammar": 'root ::= "a"'}},
            {"grammar": 'root ::= "a"'},
            "structured_outputs",
        ),
        (
            {"structured_outputs": {"json_object": True, "disable_any_whitespace": False}},
            {"json_object": True, "disable_any_whitespace": False},
            "structured_outputs",
        ),
        (
            {
                "structured_outputs": {
                    "regex": "a",
                    "disable_fallback": True,
                    "disable_additional_properties": True,
                }
            },
            {"regex": "a"},
            "structured_outputs",
        ),
        ({"guided_json": SCHEMA}, {"json": SCHEMA}, "guided_json"),
        ({"guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}, "guided_regex"),
        ({"guided_choice": ["a", "b"]}, {"choice": ["a", "b"]}, "guided_choice"),
        ({"guided_grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}, "guided_grammar"),
        (
            {"guided_regex": "a", "guided_decoding_backend": "xgrammar"},
            {"regex": "a"},
            "guided_regex",
        ),
        ({"guided_decoding_backend": "auto"}, None, None),
    ],
)
def test_each_way_of_asking_maps_to_one_constraint(fields, expected, field):
    so, given = constraint(**fields)
    assert given == field
    assert so == (None if expected is None else StructuredOutputs.from_dict(expected))
    assert chat(**fields).constraint_field == field


def test_completions_take_the_same_fields():
    req = CompletionRequest.model_validate_json(
        json.dumps({"prompt": "x", "guided_choice": ["a", "b"]})
    )
    params = req.sampling_params(4, None)
    assert params.structured_outputs == StructuredOutputs(choice=("a", "b"))


def test_sampling_params_carry_the_constraint():
    params = chat(response_format={"type": "json_object"}).sampling_params(8, None)
    assert params.structured_outputs == StructuredOutputs(json_object=True)


@pytest.mark.parametrize(
    "fields, param, words",
    [
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "response_format",
            "response_format, guided_regex",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "guided_json": SCHEMA},
            "structured_outputs",
            "structured_outputs, guided_json",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "one of"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        (
            {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
            "structured_outputs",
            "whitespace_pattern",
        ),
        (
            {"structured_outputs": {"structural_tag": "{}"}},
            "structured_outputs",
            "structural_tag",
        ),
        ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern", "not supported"),
        (
            {"guided_regex": "a", "guided_decoding_backend": "outlines"},
            "guided_decoding_backend",
            "xgrammar",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "response_format.json_schema.schema is required",
        ),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"guided_regex": ""}, "guided_regex", "guided_regex must be a non-empty string"),
        ({"guided_regex": "a" * 5000}, "guided_regex", "the limit is 4096"),
        ({"guided_json": "{not json"}, "guided_json", "guided_json is not valid JSON"),
    ],
)
def test_refusals_name_the_field(fields, param, words):
    err = refused(**fields)
    assert err.param == param
    assert words in err.message


def test_deep_schema_is_refused_naming_the_field_and_the_limit():
    schema: dict = {"type": "string"}
    for _ in range(40):  # 80 levels of the document (pydantic's JSON parser stops at ~200)
        schema = {"type": "array", "items": schema}
    rf = {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}
    err = refused(response_format=rf)
    assert err.param == "response_format"
    assert err.message.startswith("response_format.json_schema.schema nests")
    assert f"the limit is {MAX_SCHEMA_DEPTH}" in err.message


def test_huge_enum_is_refused_by_size():
    err = refused(guided_json={"enum": [f"v{i}" for i in range(100_000)]})
    assert err.param == "guided_json" and "the limit is 65536" in err.message


@pytest.mark.parametrize(
    "fields, where",
    [
        ({"response_format": {}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format",
        ),
        ({"structured_outputs": {"regex": 5}}, "structured_outputs"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
        ({"structured_outputs": "a+"}, "structured_outputs"),
        ({"guided_choice": "a"}, "guided_choice"),
        ({"guided_json": 3}, "guided_json"),
    ],
)
def test_bad_shapes_fail_validation_at_the_field(fields, where):
    with pytest.raises(ValidationError) as info:
        chat(**fields)
    assert info.value.errors()[0]["loc"][0] == where


def test_messages_are_said_of_the_field_sent():
    message = "structured_outputs.json could not be compiled: bad"
    assert in_field(message, "response_format") == (
        "response_format.json_schema.schema could not be compiled: bad"
    )
    assert in_field(message, "guided_json") == "guided_json could not be compiled: bad"
    assert in_field(message, "structured_outputs") == message
    assert in_field("structured_outputs.regex did not compile", "guided_regex") == (
        "guided_regex did not compile"
    )
