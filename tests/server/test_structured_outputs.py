"""Structured outputs through the servers, with the real default model and the official ``openai``
client: ``response_format`` (json_schema, json_object), vLLM's ``structured_outputs``, the older
``guided_*`` aliases, ``beta.chat.completions.parse``, streams, truncation, the 400s naming the
field, hostile constraints, and the same constraint over RPC.

The model is tiny (SmolLM2-135M): its outputs are valid by construction, not smart. Every schema
is bounded (strings have a maxLength, arrays a maxItems, numbers a range) so that ``max_tokens``
always suffices and 100% of the outputs finish with "stop".
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from serverutil import MODEL, RPCThread, wait_idle

from engine.sampling_params import SamplingParams
from engine.structured.params import StructuredOutputs

ASK = [{"role": "user", "content": "Describe a person as JSON."}]
NAME = {"type": "string", "maxLength": 12}
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": NAME,
            "address": {
                "type": "object",
                "properties": {
                    "city": NAME,
                    "zip": {"type": "integer", "minimum": 0, "maximum": 99999},
                },
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "array": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
    },
    "ranges": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "score": {"type": "integer", "minimum": -5, "maximum": 5},
        },
        "required": ["age", "score"],
    },
    "optional": {
        "type": "object",
        "properties": {
            "name": NAME,
            "nickname": NAME,
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name"],
    },
    "any_of": {
        "type": "object",
        "properties": {
            "id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, NAME]},
        },
        "required": ["id"],
    },
}
MAX_TOKENS = 100  # far above what any schema above can take compactly


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


def _json_schema(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schemas_stop_parse_and_validate(client, temperature):
    def ask(item):
        name, schema = item
        r = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=MAX_TOKENS,
            temperature=temperature,
            seed=7,
            response_format=_json_schema(name, schema),
        )
        return name, schema, r.choices[0]

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # batched together in the engine
        results = list(pool.map(ask, SCHEMAS.items()))
    for name, schema, choice in results:
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[
            {
                "role": "user",
                "content": 'Is fire hot? Reply only {"answer": "yes"} or {"answer": "no"}.',
            }
        ],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_object"},
    )
    # A prompt that this model answers with a short object, so that the object ends.
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_regex_and_choice_via_structured_outputs(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give a code."}],
        max_tokens=20,
        temperature=1.0,
        seed=3,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}},
    )
    assert r.choices[0].finish_reason == "stop"
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", r.choices[0].message.content)
    colors = ["red", "green", "blue"]
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Pick a color."}],
        max_tokens=10,
        temperature=0,
        n=3,
        seed=5,
        extra_body={"structured_outputs": {"choice": colors}},
    )
    assert all(c.message.content in colors and c.finish_reason == "stop" for c in r.choices)


def test_grammar_on_completions(client):
    r = client.completions.create(
        model=MODEL,
        prompt="Is the sky blue? Answer:",
        max_tokens=10,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": 'root ::= " yes" | " no"'}},
    )
    assert r.choices[0].text in (" yes", " no") and r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"guided_choice": ["cat", "dog"]}, lambda t: t in ("cat", "dog")),
        ({"guided_regex": "[A-Z][a-z]{2,5}"}, lambda t: re.fullmatch("[A-Z][a-z]{2,5}", t)),
        (
            {"guided_json": SCHEMAS["enum"], "guided_decoding_backend": "xgrammar"},
            lambda t: jsonschema.validate(json.loads(t), SCHEMAS["enum"]) is None,
        ),
        ({"guided_grammar": 'root ::= "a" "b"?'}, lambda t: t in ("a", "ab")),
    ],
)
def test_guided_aliases_on_completions(client, extra, check):
    r = client.completions.create(
        model=MODEL, prompt="Answer:", max_tokens=40, temperature=0, extra_body=extra
    )
    assert r.choices[0].finish_reason == "stop" and check(r.choices[0].text)


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    city: str = Field(max_length=12)


def test_parse_with_a_pydantic_model(client):
    r = client.beta.chat.completions.parse(
        model=MODEL, messages=ASK, response_format=Person, max_tokens=MAX_TOKENS, temperature=0
    )
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


def test_truncated_json_finishes_with_length(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=3,
        temperature=0,
        response_format=_json_schema("nested", SCHEMAS["nested"]),
    )
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.choices[0].message.content)


def test_stream_with_a_constraint(client):
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        max_tokens=MAX_TOKENS,
        temperature=0,
        response_format=_json_schema("array", SCHEMAS["array"]),
    )
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMAS["array"])
    assert text == client.chat.completions.create(**kwargs).choices[0].message.content


def _post_chat(http, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 8, **fields}
    return http.post("/v1/chat/completions", json=body)


@pytest.mark.parametrize(
    "fields, param, words",
    [
        (
            {"response_format": _json_schema("x", {"type": "no-such-type"})},
            "response_format",
            "response_format.json_schema.schema could not be compiled",
        ),
        ({"guided_regex": "(unclosed"}, "guided_regex", "guided_regex could not be compiled"),
        (
            {"structured_outputs": {"grammar": "root ::= undefined_rule"}},
            "structured_outputs",
            "structured_outputs.grammar could not be compiled",
        ),
        (
            {"response_format": {"type": "json_object"}, "guided_choice": ["a"]},
            "response_format",
            "response_format, guided_choice",
        ),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag"),
        (
            {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
            "structured_outputs",
            "whitespace_pattern",
        ),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "not supported"),
        (
            {"guided_regex": "a", "guided_decoding_backend": "outlines"},
            "guided_decoding_backend",
            "xgrammar",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "schema is required",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "response_format"),
        ({"structured_outputs": {"regex": "a"}, "min_tokens": 2}, "min_tokens", "min_tokens"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(http, fields, param, words):
    r = _post_chat(http, **fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


# -- hostile constraints ------------------------------------------------------------------------


def _nested(levels: int) -> dict:
    schema: dict = {"type": "string", "maxLength": 4}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_hostile_schemas_are_clear_400s(http):
    r = _post_chat(http, response_format=_json_schema("deep", _nested(30)))
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "response_format"
    assert "nests 61 levels deep; the limit is 32" in err["message"]
    # 200 levels: the request body itself nests past the JSON parser's limit.
    r = _post_chat(http, response_format=_json_schema("deep", _nested(200)))
    assert r.status_code == 400 and "recursion limit" in r.json()["error"]["message"]
    r = _post_chat(http, guided_json={"enum": [f"value-{i}" for i in range(100_000)]})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "guided_json"
    assert "the limit is 65536" in err["message"]
    r = _post_chat(http, guided_choice=[f"c{i}" for i in range(5000)])
    err = r.json()["error"]
    assert r.status_code == 400 and "5000 entries; the limit is 1024" in err["message"]


TREE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer", "minimum": 0, "maximum": 9},
                "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
            },
            "required": ["v", "kids"],
        }
    },
    "$ref": "#/$defs/node",
}


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": _json_schema("tree", TREE)},  # recursive $ref: xgrammar recurses
        {"guided_regex": "(a|aa)*b{1000}"},
        {"guided_regex": "(a{1,1000}){1,1000}"},
        {"guided_regex": "((a|b){1,50}c){1,50}"},
    ],
)
def test_recursive_and_pathological_constraints_compile_and_are_served(http, fields):
    """xgrammar compiles these in milliseconds (its automata are lazy): served, not refused.
    The output matches as far as it went; a tree may nest until max_tokens."""
    r = _post_chat(http, temperature=0, **fields)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if "guided_regex" in fields:
        assert choice["finish_reason"] == "length"  # b{1000} etc. outlast 8 tokens
        assert re.fullmatch("[abc]+", choice["message"]["content"])
    elif choice["finish_reason"] == "stop":
        jsonschema.validate(json.loads(choice["message"]["content"]), TREE)


@pytest.fixture
def compiler(llm):
    c = llm.engine.grammar_compiler
    saved = c.timeout, c.max_pending, c._compile_now
    yield c
    c.timeout, c.max_pending = saved[:2]
    c.__dict__.pop("_compile_now", None)


def test_the_engine_finds_the_constraint_compiled(http, compiler):
    """The server compiles off its event loop first; the engine loop's add is a cache hit."""
    compiles, hits = compiler.compiles, compiler.hits
    r = _post_chat(http, guided_regex="[0-9]{2}-precompiled", temperature=0)
    assert r.status_code == 200
    assert (compiler.compiles, compiler.hits) == (compiles + 1, hits + 1)


def test_compile_past_the_deadline_is_a_400(http, compiler):
    compiler.timeout = 0  # any compile that is not already done is past it
    r = _post_chat(http, guided_regex="[0-9]{2}-deadline")
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "guided_regex"
    assert "did not compile within 0 s" in err["message"]


def test_too_many_pending_compiles_is_a_503(http, compiler):
    compiler.max_pending = 0
    r = _post_chat(http, structured_outputs={"regex": "[0-9]{2}-busy"})
    assert r.status_code == 503 and r.json()["error"]["param"] == "structured_outputs"
    assert "Retry-After" in r.headers


def test_server_serves_others_while_a_compile_runs(http, compiler, llm):
    """A compile held on the pool does not hold the event loop or the engine: an unconstrained
    request sent meanwhile completes, then the constrained one does."""
    entered, release = threading.Event(), threading.Event()
    real = compiler._compile_now

    def slow(so):
        if so.regex == "slow-[0-9]":
            entered.set()
            release.wait(60)
        return real(so)

    compiler._compile_now = slow
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(_post_chat, http, guided_regex="slow-[0-9]", temperature=0)
        assert entered.wait(60)
        try:
            r = _post_chat(http, temperature=0)
            assert r.status_code == 200 and not held.done()
        finally:
            release.set()
        r = held.result(60)
    assert r.status_code == 200 and re.fullmatch(
        "slow-[0-9]", r.json()["choices"][0]["message"]["content"]
    )
    wait_idle(llm)


# -- RPC ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rpc_client(llm):
    from engine.client import RPCClient

    with RPCThread(llm) as server, RPCClient(server.address, timeout=300) as c:
        yield c


def test_rpc_takes_the_constraint(rpc_client):
    schema = SCHEMAS["enum"]
    r = rpc_client.generate(
        "A color as JSON:", max_tokens=40, temperature=0, structured_outputs={"json": schema}
    )
    assert r.outputs[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.text), schema)
    params = SamplingParams(
        max_tokens=10, temperature=0, structured_outputs=StructuredOutputs(choice=("yes", "no"))
    )
    assert rpc_client.generate("Yes or no?", params).text in ("yes", "no")
    so = StructuredOutputs(regex="[0-9]{4}")
    text = "".join(
        d.text for d in rpc_client.stream("A year:", max_tokens=10, structured_outputs=so)
    )
    assert re.fullmatch("[0-9]{4}", text)


def test_rpc_refuses_bad_constraints_naming_the_field(rpc_client):
    from engine.client import RPCError

    for so, words in (
        ({"regex": "(unclosed"}, "structured_outputs.regex could not be compiled"),
        ({"json": {"type": "object"}, "regex": "a"}, "exactly one"),
        ({"choice": "ab"}, "structured_outputs.choice must be a list"),
        ({"whitespace_pattern": " "}, "unknown fields: whitespace_pattern"),
    ):
        with pytest.raises(RPCError) as info:
            rpc_client.generate("x", max_tokens=4, structured_outputs=so)
        assert info.value.code == 400 and info.value.param == "structured_outputs", so
        assert words in info.value.message
