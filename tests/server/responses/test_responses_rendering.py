"""A continued conversation renders as a prefix-extension of the previous one: the new prompt's
tokens are the previous prompt's, then the previous reply's (text, or a function call in the
default model's generic tool-call format), then the new turn's, so that the engine's prefix cache
finds the whole previous request. Rendered with the default model's real template and tokenizer;
nothing is generated (the replies are given)."""

from __future__ import annotations

import pytest

from engine.outputs import CompletionOutput, RequestOutput
from engine.server.openai_serving import OpenAIServing
from engine.server.responses.protocol import ResponsesRequest
from engine.server.responses.rendering import output_items
from engine.server.responses.serving import ResponsesServing
from engine.server.responses.store import ResponseStore
from engine.structured.tool_parsers import ParsedCall

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]


@pytest.fixture(scope="module")
def serving(llm) -> ResponsesServing:
    return ResponsesServing(OpenAIServing(llm, ["default"]), ResponseStore())


def _answered(serving, body: dict, reply: str, calls: list[ParsedCall]):
    """The job of ``body``, finished with ``reply`` (the model's text) and stored."""
    job = serving.job(ResponsesRequest.model_validate(body))
    ids = serving.chat.tokenizer.encode(reply, add_special_tokens=False)
    out = CompletionOutput(index=0, text=reply, token_ids=ids, finish_reason="stop")
    final = RequestOutput(job.id, None, job.chat.prompts[0], [out], finished=True)
    text = None if calls else reply
    response = serving.finish(job, final, output_items(text, calls, "completed"))
    return job, ids, response


@pytest.mark.parametrize("tools", [False, True], ids=["text", "function-call"])
def test_a_continuation_extends_the_previous_prompt_and_reply(serving, tools):
    common = {"instructions": "Be brief."} | ({"tools": TOOLS} if tools else {})
    if tools:  # the generic format's call object, as the grammar makes the model write it
        reply = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}'
        calls = [ParsedCall("get_weather", '{"city": "Paris"}')]
    else:
        reply, calls = "It is sunny in Paris today.", []
    first, reply_ids, response = _answered(
        serving, common | {"input": "What is the weather in Paris?"}, reply, calls
    )
    if tools:
        [call] = response["output"]
        more = [{"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}]
    else:
        more = "And in Rome?"
    second = serving.job(
        ResponsesRequest.model_validate(common | {"previous_response_id": first.id, "input": more})
    )
    p1, p2 = first.chat.prompts[0], second.chat.prompts[0]
    assert p2[: len(p1) + len(reply_ids)] == p1 + reply_ids
    assert len(p2) > len(p1) + len(reply_ids)
