"""A Responses conversation as chat messages (what the chat template renders), and a reply as the
response's output items.

The conversation of a request is the stored conversation of its ``previous_response_id`` (that
response's input and output, without its instructions), then its own ``input``; the prompt is
``instructions`` as a system message, then the conversation, rendered as /v1/chat/completions
renders the same messages (tools in the model's tool-call format, docs/tool_calls.md). A
continued conversation therefore renders to the previous prompt, the previous reply, and the new
turns after them: the previous request's tokens are a prefix of the new prompt, and the engine's
prefix cache finds them (when the instructions and tools are the same).

Items map onto messages one to one, except that an assistant's text and the function calls right
after it are one assistant message (its content and ``tool_calls``), as a chat reply holds both:
- ``message`` (system, developer, user, assistant): a message of that role, its parts' text
  joined;
- ``function_call``: a call in the ``tool_calls`` of an assistant message;
- ``function_call_output``: a ``tool`` message answering the call with that ``call_id``.
"""

from __future__ import annotations

import uuid

from engine.server.openai_protocol import ChatMessage, FunctionCall, ToolCall
from engine.server.responses.protocol import (
    FunctionCallItem,
    Item,
    MessageItem,
    parts,
)
from engine.server.tool_calls import call_id
from engine.structured.tool_parsers import ParsedCall


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def to_messages(items: list[Item]) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    for i, item in enumerate(items):
        if isinstance(item, MessageItem):
            content = item.content
            if isinstance(content, list):
                content = parts(content, f"input.{i}.content")
            out.append(ChatMessage(role=item.role, content=content))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(
                id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
            )
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and _open(items, i):
                out[-1] = last.model_copy(update={"tool_calls": [*(last.tool_calls or []), call]})
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        else:
            output = item.output
            if isinstance(output, list):
                output = parts(output, f"input.{i}.output", ("input_text",))
            out.append(ChatMessage(role="tool", content=output, tool_call_id=item.call_id))
    return out


def _open(items: list[Item], i: int) -> bool:
    """Whether the function call ``items[i]`` follows an assistant's text or calls directly."""
    prev = items[i - 1] if i > 0 else None
    return isinstance(prev, FunctionCallItem) or (
        isinstance(prev, MessageItem) and prev.role == "assistant"
    )


def instructions_message(instructions: str | None) -> list[ChatMessage]:
    return [] if instructions is None else [ChatMessage(role="system", content=instructions)]


# -- output items ------------------------------------------------------------------------------


def message_item(item_id: str, text: str, status: str) -> dict:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [output_text(text)] if status != "in_progress" else [],
    }


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(call: ParsedCall) -> dict:
    """A call's item, completed (the streamed one starts as a copy with no arguments)."""
    return {
        "id": new_id("fc"),
        "type": "function_call",
        "call_id": call_id(),
        "name": call.name,
        "arguments": call.arguments,
        "status": "completed",
    }


def output_items(text: str | None, calls: list[ParsedCall], status: str) -> list[dict]:
    """A reply's output: its text as a message (when it has text, or nothing else), then one
    function_call item per call."""
    out = []
    if text or not calls:
        out.append(message_item(new_id("msg"), text or "", status))
    out.extend(function_call_item(c) for c in calls)
    return out


def output_messages(output: list[dict]) -> list[ChatMessage]:
    """A response's output items as the conversation's next messages."""
    items: list[Item] = []
    for o in output:
        if o["type"] == "message":
            text = "".join(p["text"] for p in o["content"])
            items.append(MessageItem(role="assistant", content=text))
        else:
            items.append(
                FunctionCallItem(
                    type="function_call",
                    call_id=o["call_id"],
                    name=o["name"],
                    arguments=o["arguments"],
                )
            )
    return to_messages(items)


def status_of(finish_reason: str | None) -> tuple[str, dict | None]:
    """A response's status from its reply's finish reason, with its incomplete_details or
    error."""
    if finish_reason == "stop":
        return "completed", None
    if finish_reason == "length":
        return "incomplete", {"incomplete": {"reason": "max_output_tokens"}}
    message = f"the request ended before its reply (finish_reason {finish_reason!r})"
    return "failed", {"error": {"code": "server_error", "message": message}}
