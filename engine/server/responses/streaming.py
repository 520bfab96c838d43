"""A streamed response: OpenAI's typed server-sent events, in their order, each with its
``sequence_number`` (0, 1, 2, ...) and an ``event:`` line naming its type.

    response.created, response.in_progress
    for the reply's text (when it has some, or nothing else):
        response.output_item.added (a message), response.content_part.added (output_text),
        response.output_text.delta ..., response.output_text.done,
        response.content_part.done, response.output_item.done
    for each function call:
        response.output_item.added (a function_call), response.function_call_arguments.delta,
        response.function_call_arguments.done, response.output_item.done
    response.completed (or response.incomplete when max_output_tokens cut the reply, or
    response.failed)

Text goes out as it comes. With tools, what may become a call is held back as on the chat route
(tool_calls.py: a reply that starts with "{" in the generic format), and each call goes out whole
when the reply ends: its arguments in one delta. An error after the headers went out is an
``error`` event, then ``response.failed``.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator

from engine.outputs import RequestOutput
from engine.server.errors import to_api_error
from engine.server.openai_serving import dumps
from engine.server.responses.rendering import (
    function_call_item,
    message_item,
    new_id,
    output_text,
    status_of,
)
from engine.server.streams import RequestStreams
from engine.server.tool_calls import ToolCallStream

# The event that ends a stream, by the response's status.
_LAST = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
}


class EventWriter:
    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return b"event: " + kind.encode() + b"\ndata: " + dumps(data) + b"\n\n"


class _Message:
    """The reply's text item while it streams."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.id = new_id("msg")
        self.text = ""

    def where(self) -> dict:
        return {"item_id": self.id, "output_index": self.index, "content_index": 0}

    def open(self, event: EventWriter) -> bytes:
        item = message_item(self.id, "", "in_progress")
        return event("response.output_item.added", output_index=self.index, item=item) + event(
            "response.content_part.added", part=_part(""), **self.where()
        )

    def delta(self, event: EventWriter, text: str) -> bytes:
        self.text += text
        return event("response.output_text.delta", delta=text, logprobs=[], **self.where())

    def close(self, event: EventWriter, status: str) -> tuple[bytes, dict]:
        item = message_item(self.id, self.text, status)
        out = event("response.output_text.done", text=self.text, logprobs=[], **self.where())
        out += event("response.content_part.done", part=_part(self.text), **self.where())
        out += event("response.output_item.done", output_index=self.index, item=item)
        return out, item


def _part(text: str) -> dict:
    part = output_text(text)
    part.pop("logprobs")
    return part


def _call_events(event: EventWriter, index: int, item: dict) -> bytes:
    added = copy.deepcopy(item) | {"arguments": "", "status": "in_progress"}
    where = {"item_id": item["id"], "output_index": index}
    out = event("response.output_item.added", output_index=index, item=added)
    out += event("response.function_call_arguments.delta", delta=item["arguments"], **where)
    out += event(
        "response.function_call_arguments.done",
        arguments=item["arguments"],
        name=item["name"],
        **where,
    )
    return out + event("response.output_item.done", output_index=index, item=item)


async def events(serving, job, streams: RequestStreams) -> AsyncIterator[bytes]:
    """The events of ``job`` (a ResponseJob of ResponsesServing ``serving``)."""
    event = EventWriter()
    head = serving.response_object(job, "in_progress", [])
    yield event("response.created", response=head) + event("response.in_progress", response=head)
    tools = job.chat.tools
    calls_stream = (
        None if tools is None else ToolCallStream(serving.chat.tool_parser, tools.parallel)
    )
    message: _Message | None = None
    output: list[dict] = []
    final: RequestOutput | None = None
    try:
        async for _, out in streams:
            final = out
            c = out.outputs[0]
            done = c.finish_reason is not None
            text, calls = c.new_text, []
            if calls_stream is not None:
                text, calls = calls_stream.feed(c.new_text, done)
            chunk = b""
            if text:
                if message is None:
                    message = _Message(len(output))
                    chunk += message.open(event)
                chunk += message.delta(event, text)
            if done:
                status, _ = status_of(c.finish_reason)
                if message is None and not calls:  # an empty reply is an empty message
                    message = _Message(len(output))
                    chunk += message.open(event)
                if message is not None:
                    closed, item = message.close(event, status)
                    chunk += closed
                    output.append(item)
                for call in calls:
                    item = function_call_item(call)
                    chunk += _call_events(event, len(output), item)
                    output.append(item)
            if chunk:
                yield chunk
    except Exception as exc:
        err = to_api_error(exc)
        failed = serving.response_object(job, "failed", output)
        failed["error"] = {"code": "server_error", "message": err.message}
        yield event("error", code=str(err.status), message=err.message, param=err.param)
        yield event("response.failed", response=failed)
        return
    finally:
        await streams.aclose()
    assert final is not None  # RequestStreams ends on a finished output
    response = serving.finish(job, final, output)
    yield event(_LAST[response["status"]], response=response)
