"""``POST /v1/responses``: a request -> one chat-style engine request -> a response object (or its
events, streaming.py), stored for ``previous_response_id`` and ``GET`` unless ``store`` is false.

It rides on the chat route's machinery (OpenAIServing): the same template rendering, tool-call
formats and grammars, structured outputs and admission; only the shapes differ. Knows nothing of
HTTP, like OpenAIServing: it returns dicts and raises APIError or the engine's exceptions.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.errors import RequestError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.server.errors import APIError, to_api_error
from engine.server.openai_protocol import (
    ChatMessage,
    ChatTool,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    tool_request,
)
from engine.server.openai_serving import Job, OpenAIServing
from engine.server.openai_structured import in_field
from engine.server.responses.protocol import (
    FunctionChoice,
    ResponsesRequest,
    TextFormatJSONObject,
    TextFormatJSONSchema,
    parse_items,
    parse_tool_choice,
    parse_tools,
)
from engine.server.responses.rendering import (
    instructions_message,
    new_id,
    output_items,
    output_messages,
    status_of,
    to_messages,
)
from engine.server.responses.store import ResponseStore, StoredResponse
from engine.server.responses.streaming import events
from engine.server.streams import RequestStreams
from engine.server.tokenize_pool import check_prompt_chars
from engine.server.tool_calls import parse_reply
from engine.structured.params import StructuredOutputs
from engine.structured.tools import ToolRequest, constraint

# The engine's names for what a RequestError blames, as this route's fields.
ALIASES = {"prompt": "input", "messages": "input", "max_tokens": "max_output_tokens"}


@dataclass
class ResponseJob:
    """One request, resolved: the chat job the engine runs, and what the response echoes."""

    chat: Job
    body: ResponsesRequest
    conversation: list[ChatMessage]  # the stored one continued, then the input
    tools: list[dict]  # as the response echoes them

    @property
    def id(self) -> str:
        return self.chat.id


class ResponsesServing:
    def __init__(self, chat: OpenAIServing, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    # -- resolving requests ------------------------------------------------------------------------

    def job(self, body: ResponsesRequest) -> ResponseJob:
        model = self.chat.check_model(body.model)
        body.check_fields()
        conversation: list[ChatMessage] = []
        if body.previous_response_id is not None:
            previous = self.store.get(body.previous_response_id)
            if previous is None:
                raise APIError(
                    400,
                    f"Previous response with id {body.previous_response_id!r} not found.",
                    "previous_response_id",
                )
            conversation = list(previous.conversation)
        conversation += to_messages(parse_items(body.input))
        tools_given = parse_tools(body.tools)
        tools = self._tool_request(tools_given, body)
        messages = instructions_message(body.instructions) + conversation
        chars = sum(len(m.text()) for m in messages)
        llm = self.chat.llm
        check_prompt_chars(chars, self.chat.tokenizer, llm.max_model_len, "input")
        try:
            prompt = self.chat.render_chat(messages, True, None, tools)
        except APIError as exc:
            message = exc.message.replace("messages", "input", 1)
            raise APIError(exc.status, message, "input") from None
        params, field = self._params(body, tools, len(prompt))
        chat = Job(
            chat=True,
            id=new_id("resp"),
            model=model,
            prompts=[prompt],
            params=params,
            include_usage=True,
            top_logprobs=None,
            tools=tools,
            constraint_field=field,
            priority=body.priority,
        )
        echo = [t.model_dump() for t in tools_given or ()]
        return ResponseJob(chat, body, conversation, echo)

    def _tool_request(self, given, body: ResponsesRequest) -> ToolRequest | None:
        choice = parse_tool_choice(body.tool_choice)
        if isinstance(choice, FunctionChoice):
            choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
        chat_tools = [
            ChatTool(
                type="function",
                function=FunctionDefinition(
                    name=t.name, description=t.description, parameters=t.parameters
                ),
            )
            for t in given or ()
        ]
        return tool_request(chat_tools, choice, body.parallel_tool_calls, where="")

    def _params(
        self, body: ResponsesRequest, tools: ToolRequest | None, prompt_len: int
    ) -> tuple[SamplingParams, str | None]:
        """The sampling parameters, and the field whose constraint they hold (for errors)."""
        given = {
            k: getattr(body, k) for k in ("temperature", "top_p") if getattr(body, k) is not None
        }
        room = max(1, self.chat.llm.max_model_len - prompt_len)  # as chat's default
        max_tokens = body.max_output_tokens or room
        try:
            params = SamplingParams(max_tokens=max_tokens, **given)
        except RequestError as exc:
            raise to_api_error(exc, ALIASES) from None
        so, field = None, None
        if tools is not None:
            try:
                so = constraint(self.chat.tool_format, tools)
            except RequestError as exc:  # the message names the chat shape's place
                raise APIError(400, exc.message.replace(".function.", ".", 1), "tools") from None
            field = None if so is None else "tools"
        fmt = body.format
        if isinstance(fmt, (TextFormatJSONSchema, TextFormatJSONObject)) and not (
            tools is not None and tools.forced  # a reply of calls only: no text to shape
        ):
            if so is not None:
                raise APIError(
                    400,
                    f"text.format {fmt.type} cannot be combined with these tools: with tool_choice "
                    f"{tools.choice!r} the tool-call grammar constrains the reply itself",
                    "text",
                )
            wanted = {"json": fmt.schema_} if isinstance(fmt, TextFormatJSONSchema) else None
            try:
                so = StructuredOutputs.from_dict(wanted or {"json_object": True})
            except RequestError as exc:
                raise APIError(400, in_field(exc.message, "text"), "text") from None
            field = "text"
        if so is not None:
            params = dataclasses.replace(params, structured_outputs=so)
        return params, field

    async def start(self, job: ResponseJob, request_id: str | None = None) -> RequestStreams:
        try:
            return await self.chat.start(job.chat, request_id)
        except RequestError as exc:  # the engine's: the prompt over the context, ...
            raise to_api_error(exc, ALIASES) from None

    # -- responses ---------------------------------------------------------------------------------

    async def full_response(self, job: ResponseJob, streams: RequestStreams) -> dict:
        final: RequestOutput | None = None
        try:
            async for _, out in streams:
                final = out
        finally:
            await streams.aclose()
        assert final is not None  # RequestStreams ends on a finished output
        c = final.outputs[0]
        if job.chat.tools is not None:
            text, calls = parse_reply(self.chat.tool_parser, c.text, job.chat.tools.parallel)
        else:
            text, calls = c.text, []
        status, _ = status_of(c.finish_reason)
        return self.finish(job, final, output_items(text, calls, status))

    def finish(self, job: ResponseJob, final: RequestOutput, output: list[dict]) -> dict:
        """The response object of a finished request; stored unless ``store`` is false."""
        c = final.outputs[0]
        status, details = status_of(c.finish_reason)
        response = self.response_object(job, status, output, usage(job, final), details)
        if job.body.store:
            conversation = tuple(job.conversation) + tuple(output_messages(output))
            self.store.put(job.id, StoredResponse(response, conversation))
        return response

    def response_object(
        self,
        job: ResponseJob,
        status: str,
        output: list[dict],
        usage_: dict | None = None,
        details: dict | None = None,
    ) -> dict:
        body, params = job.body, job.chat.params
        fmt = body.format
        return {
            "id": job.id,
            "object": "response",
            "created_at": job.chat.created,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": (details or {}).get("error"),
            "incomplete_details": (details or {}).get("incomplete"),
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": job.chat.model,
            "output": output,
            "parallel_tool_calls": True
            if body.parallel_tool_calls is None
            else body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "store": body.store,
            "temperature": params.temperature,
            "text": {"format": {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True)},
            "tool_choice": body.tool_choice or "auto",
            "tools": job.tools,
            "top_p": params.top_p,
            "truncation": "disabled",
            "usage": usage_,
            "user": body.user,
            "safety_identifier": body.safety_identifier,
            "background": False,
        }

    def stream(self, job: ResponseJob, streams: RequestStreams) -> AsyncIterator[bytes]:
        return events(self, job, streams)

    # -- stored ones -------------------------------------------------------------------------------

    def get(self, response_id: str) -> dict:
        entry = self.store.get(response_id)
        if entry is None:
            raise not_found(response_id)
        return entry.response

    def delete(self, response_id: str) -> dict:
        if not self.store.delete(response_id):
            raise not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


def not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id {response_id!r} not found.", "response_id")


def usage(job: ResponseJob, final: RequestOutput) -> dict:
    prompt = len(job.chat.prompts[0])
    output = len(final.outputs[0].token_ids)
    cached = final.metrics.num_cached_tokens if final.metrics else 0
    return {
        "input_tokens": prompt,
        # cache_write_tokens counts OpenAI's explicit cache writes; this server has none.
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }
