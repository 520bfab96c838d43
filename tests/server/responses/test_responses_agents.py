"""An OpenAI Agents SDK agent against /v1/responses: the agent of docs/responses.md, its block run
as written (only the server's address differs), calls its function tool once (forced by a named
tool_choice: a grammar) and answers from the tool's result (a json_schema-constrained output type,
in the second turn, which offers no tools). The same agent streamed (the SDK's streamed path over
the server's events) gives the same answer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("agents")

DOC = Path(__file__).resolve().parents[3] / "docs" / "responses.md"
ADDRESS = "http://127.0.0.1:8000"
WANT = {"city": "Paris", "sky": "sunny", "temperature_c": 21}  # the tool's result


def _agent_block() -> str:
    text = DOC.read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    [block] = [b for b in blocks if "from agents import" in b]
    assert ADDRESS in block
    return block


@pytest.fixture(scope="module")
def documented(server) -> dict:
    """The block's namespace after it ran (its agent, its ``calls`` and ``result``)."""
    ns: dict = {"__name__": "docs_agent"}
    exec(compile(_agent_block().replace(ADDRESS, server.url), str(DOC), "exec"), ns)
    return ns


def test_the_documented_agent_calls_its_tool_and_answers_from_it(documented):
    assert documented["calls"] == ["Paris"]
    result = documented["result"]
    assert result.final_output.model_dump() == WANT
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert len(result.raw_responses) == 2  # two turns, each one /v1/responses request


def test_the_agent_streamed_gives_the_same_answer(documented, server):
    ns = documented
    ns["calls"].clear()

    async def streamed():
        # A client of this event loop (the block's belongs to run_sync's).
        client = ns["AsyncOpenAI"](base_url=server.url + "/v1", api_key="unused")
        model = ns["OpenAIResponsesModel"](model="default", openai_client=client)
        agent = ns["agent"].clone(model=model)
        run = ns["Runner"].run_streamed(agent, "What is the weather in Paris?")
        kinds = [event.type async for event in run.stream_events()]
        await client.close()
        return run, kinds

    run, kinds = asyncio.run(streamed())
    assert "raw_response_event" in kinds
    assert ns["calls"] == ["Paris"]
    assert run.final_output.model_dump() == WANT
