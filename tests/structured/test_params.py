"""StructuredOutputs, the constraint a request carries: exactly one kind, the size caps name the
field and the limit, a schema given as a dict or as text is the same (hashable) constraint, and
the constraint survives the wire (engine/ipc/wire.py) inside SamplingParams."""

from __future__ import annotations

import json

import pytest

from engine.ipc.wire import params_from_wire, params_to_wire
from engine.sampling_params import SamplingParams
from engine.structured.params import (
    MAX_CHOICES,
    MAX_REGEX_CHARS,
    MAX_SCHEMA_CHARS,
    MAX_SCHEMA_DEPTH,
    StructuredOutputs,
)

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


@pytest.mark.parametrize(
    "fields, kind",
    [
        ({"json": SCHEMA}, "json"),
        ({"json_object": True}, "json_object"),
        ({"regex": "[0-9]+"}, "regex"),
        ({"choice": ["yes", "no"]}, "choice"),
        ({"grammar": 'root ::= "a"'}, "grammar"),
    ],
)
def test_each_kind_alone(fields, kind):
    assert StructuredOutputs(**fields).kind == kind


@pytest.mark.parametrize(
    "fields, given",
    [
        ({}, "none"),
        ({"json_object": False}, "none"),
        ({"json": SCHEMA, "regex": "a"}, "json, regex"),
        ({"choice": ["a"], "grammar": 'root ::= "a"'}, "choice, grammar"),
    ],
)
def test_exactly_one_kind(fields, given):
    with pytest.raises(ValueError, match=f"exactly one of .*; got {given}$"):
        StructuredOutputs(**fields)


def test_schema_as_dict_or_text_is_one_constraint_in_key_order():
    a = StructuredOutputs(json=SCHEMA)
    b = StructuredOutputs(json=json.dumps(SCHEMA, indent=2))
    assert a == b and hash(a) == hash(b)
    assert list(json.loads(a.json)["properties"]) == ["b", "a"]  # the order output writes
    assert StructuredOutputs(json={**SCHEMA, "title": "x"}) != a


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"json": [1, 2]}, "structured_outputs.json must be a JSON schema"),
        ({"json": "x" * (MAX_SCHEMA_CHARS + 1)}, f"json is .* the limit is {MAX_SCHEMA_CHARS}"),
        ({"regex": ""}, "structured_outputs.regex must be a non-empty string"),
        ({"regex": "a" * (MAX_REGEX_CHARS + 1)}, f"regex is .* the limit is {MAX_REGEX_CHARS}"),
        ({"grammar": 5}, "structured_outputs.grammar must be a non-empty string"),
        ({"choice": "yes"}, "structured_outputs.choice must be a list of strings"),
        ({"choice": []}, "structured_outputs.choice must be a non-empty list"),
        ({"choice": ["a", ""]}, "structured_outputs.choice must be a non-empty list"),
        ({"choice": ["a", 1]}, "structured_outputs.choice must be a non-empty list"),
        (
            {"choice": [str(i) for i in range(MAX_CHOICES + 1)]},
            f"choice has {MAX_CHOICES + 1} entries; the limit is {MAX_CHOICES}",
        ),
        ({"json_object": 1}, "structured_outputs.json_object must be a boolean"),
        (
            {"regex": "a", "disable_any_whitespace": "no"},
            "structured_outputs.disable_any_whitespace must be a boolean",
        ),
    ],
)
def test_refusals_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputs(**fields)


def test_deep_schema_refused_by_depth_without_recursion():
    ok = {"type": "array"}
    for _ in range(MAX_SCHEMA_DEPTH - 1):  # each level is one map
        ok = {"type": "array", "items": ok}
    StructuredOutputs(json=ok)  # at the limit
    deep = {"type": "array", "items": ok}
    with pytest.raises(ValueError, match=f"json nests .* the limit is {MAX_SCHEMA_DEPTH}"):
        StructuredOutputs(json=deep)
    # Far past the interpreter's recursion limit: refused, not a RecursionError.
    text = '{"a":' * 5000 + "1" + "}" * 5000
    with pytest.raises(ValueError, match="structured_outputs.json"):
        StructuredOutputs(json=text)


def test_from_dict_refuses_unknown_fields_and_non_maps():
    with pytest.raises(ValueError, match="unknown fields: guided_json"):
        StructuredOutputs.from_dict({"guided_json": SCHEMA})
    with pytest.raises(ValueError, match="must be a map, got list"):
        StructuredOutputs.from_dict([SCHEMA])
    so = StructuredOutputs(regex="a+")
    assert StructuredOutputs.from_dict(so) is so


def test_to_dict_holds_only_the_set_fields():
    assert StructuredOutputs(choice=("a", "b")).to_dict() == {"choice": ["a", "b"]}
    so = StructuredOutputs(json=SCHEMA, disable_any_whitespace=False)
    assert so.to_dict() == {"json": so.json, "disable_any_whitespace": False}


@pytest.mark.parametrize(
    "so",
    [
        {"json": SCHEMA},
        {"json_object": True, "disable_any_whitespace": False},
        {"regex": r"\d{3}"},
        {"choice": ["red", "green"]},
        {"grammar": 'root ::= "x" | "y"'},
    ],
)
def test_wire_round_trip(so):
    params = SamplingParams(temperature=0.5, seed=3, max_tokens=9, structured_outputs=so)
    assert isinstance(params.structured_outputs, StructuredOutputs)
    wire = params_to_wire(params)
    assert wire["structured_outputs"] == params.structured_outputs.to_dict()
    back = params_from_wire(json.loads(json.dumps(wire)))  # through JSON, as a socket would
    assert back == params
    assert back.structured_outputs == params.structured_outputs


def test_wire_without_a_constraint_and_refusals():
    params = SamplingParams(max_tokens=3)
    assert params_to_wire(params)["structured_outputs"] is None
    assert params_from_wire(params_to_wire(params)).structured_outputs is None
    wire = params_to_wire(params)
    with pytest.raises(ValueError, match="structured_outputs must be a map, got str"):
        params_from_wire({**wire, "structured_outputs": "json"})
    with pytest.raises(ValueError, match="exactly one of"):
        params_from_wire({**wire, "structured_outputs": {}})


def test_min_tokens_refused_with_a_constraint():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a"})
