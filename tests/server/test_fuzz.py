"""Property-based fuzzing of request bodies: whatever a client sends, the server answers with
a 2xx or a 4xx in OpenAI's error shape, never a 500, and never hangs (each request has a
deadline). Generated values mix plausible ones with wrong types and out-of-range numbers;
output lengths stay small so that a valid request finishes quickly on a CPU.

The suite runs a fixed (derandomized) set of examples; ``ENGINE_FUZZ_EXAMPLES=500`` runs a
longer, randomized search."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serverutil import wait_idle

FUZZ = settings(
    max_examples=int(os.environ.get("ENGINE_FUZZ_EXAMPLES", "20")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize="ENGINE_FUZZ_EXAMPLES" not in os.environ,
)
REQUEST_TIMEOUT_S = 60.0

# Integers are either small or huge, never a few hundred, so no valid request runs long.
ints = st.integers(-3, 4) | st.integers(2**31, 2**70) | st.integers(-(2**70), -(2**31))
scalars = st.none() | st.booleans() | ints | st.floats(allow_nan=False) | st.text(max_size=12)
anything = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


def either(valid: st.SearchStrategy) -> st.SearchStrategy:
    return valid | anything


SAMPLING = {
    "model": either(st.sampled_from(["default", "other-model"])),
    "temperature": either(st.floats(-1, 3)),
    "top_p": either(st.floats(-0.5, 1.5)),
    "top_k": either(st.integers(-2, 50)),
    "min_p": either(st.floats(-0.5, 1.5)),
    "n": either(st.integers(-1, 3)),
    "seed": either(st.integers(-(2**64), 2**64)),
    "stop": either(st.lists(st.text(max_size=3), max_size=3) | st.text(max_size=3)),
    "stop_token_ids": either(st.lists(st.integers(-2, 50000), max_size=3)),
    "presence_penalty": either(st.floats(-3, 3)),
    "frequency_penalty": either(st.floats(-3, 3)),
    "repetition_penalty": either(st.floats(-1, 3)),
    "ignore_eos": either(st.booleans()),
    "min_tokens": either(st.integers(-1, 6)),
    "stream": st.booleans(),
    "stream_options": either(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "logit_bias": either(st.dictionaries(st.text(max_size=3), st.floats(-1, 1), max_size=2)),
    "best_of": either(st.integers(0, 3)),
    "response_format": either(
        st.sampled_from(
            [
                {"type": "text"},
                {"type": "json_object"},
                {"type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": [1, 2]}}},
            ]
        )
    ),
    "structured_outputs": either(
        st.fixed_dictionaries(
            {},
            optional={
                "regex": st.text(max_size=8),
                "choice": st.lists(st.text(max_size=4), max_size=3),
                "json": anything,
                "grammar": st.text(max_size=12),
                "disable_any_whitespace": st.booleans(),
            },
        )
    ),
    "guided_regex": either(st.text(max_size=8)),
}
prompts = st.text(max_size=40) | st.lists(st.integers(-5, 60000), max_size=8)
completion_bodies = st.fixed_dictionaries(
    {"prompt": either(prompts | st.lists(st.text(max_size=10), max_size=3))},
    optional={
        **SAMPLING,
        "max_tokens": either(st.integers(-2, 4)),
        "logprobs": either(st.integers(-1, 25)),
        "echo": either(st.booleans()),
    },
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": either(st.sampled_from(["system", "user", "assistant"])),
            "content": either(st.text(max_size=30)),
        }
    ),
    max_size=3,
)
chat_bodies = st.fixed_dictionaries(
    {
        "messages": either(messages),
        "max_completion_tokens": st.integers(-1, 4) | st.sampled_from(["4", 10**9, 2.0]),
    },
    optional={
        **SAMPLING,
        "logprobs": either(st.booleans()),
        "top_logprobs": either(st.integers(-1, 25)),
    },
)


@pytest.fixture(scope="module")
def fuzz_client(server):
    with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as client:
        yield client


def check(client: httpx.Client, path: str, body) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    with client.stream(
        "POST", path, content=data, headers={"content-type": "application/json"}
    ) as r:
        raw = r.read()
    assert r.status_code < 500, (body, r.status_code, raw[:500])
    if r.status_code != 200:
        err = json.loads(raw)["error"]
        assert {"message", "type", "param", "code"} <= set(err) and err["code"] == r.status_code
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in raw.decode().split("\n\n") if line]
        assert events[-1] == "data: [DONE]", (body, raw[-300:])
        for event in events[:-1]:
            chunk = json.loads(event.removeprefix("data: "))
            assert "error" not in chunk, (body, chunk)
    else:
        assert json.loads(raw)["choices"] is not None


@FUZZ
@given(body=completion_bodies)
def test_fuzz_completions(fuzz_client, body):
    check(fuzz_client, "/v1/completions", body)


@FUZZ
@given(body=chat_bodies)
def test_fuzz_chat(fuzz_client, body):
    check(fuzz_client, "/v1/chat/completions", body)


@settings(max_examples=10, deadline=None, derandomize=True)
@given(raw=st.binary(max_size=64) | anything.map(lambda v: json.dumps(v).encode()))
def test_fuzz_raw_bodies(fuzz_client, raw):
    check(fuzz_client, "/v1/completions", raw)


def test_engine_idle_after_fuzzing(llm):
    wait_idle(llm)
