"""/v1/responses in front of a real cluster (the router in this process, one prefill and one decode
worker process), through the HTTP app ``engine cluster`` serves: a response, its continuation by
``previous_response_id`` whose prompt the prefill worker finds in its prefix cache, the same reply
streamed as typed events, and a forced function call."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from server.serverutil import http_server

from engine.cluster.launcher import Cluster
from engine.cluster.router.router import RouterConfig
from engine.config import CacheConfig

WORKER_ARGS = ["--kv-cache-memory-gb", "0.25", "--kv-staging-mb", "64", "--dtype", "float32"]
INSTRUCTIONS = "You are a geography tutor. Answer every question in one short sentence."


@pytest.fixture(scope="module")
def server():
    with Cluster(1, 1, worker_args=WORKER_ARGS, router_config=RouterConfig()) as c:
        with http_server(c.router) as srv:
            yield srv


def test_responses_through_the_cluster(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    kwargs = {"model": "default", "temperature": 0, "instructions": INSTRUCTIONS}
    first = client.responses.create(
        input="What is the capital of France?", max_output_tokens=12, **kwargs
    )
    assert first.status in ("completed", "incomplete") and first.output_text
    second = client.responses.create(
        previous_response_id=first.id, input="And of Italy?", max_output_tokens=12, **kwargs
    )
    block = CacheConfig().block_size
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens // block * block > 0

    events = []
    body = {**kwargs, "input": "What is the capital of France?", "max_output_tokens": 12}
    with httpx.stream("POST", server.url + "/v1/responses", json=body | {"stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == first.output_text

    tool = {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    called = client.responses.create(
        model="default",
        input="What is the weather in Paris?",
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=40,
        temperature=0,
    )
    [call] = called.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert isinstance(json.loads(call.arguments), dict)
