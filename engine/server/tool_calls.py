"""The ``tool_calls`` of a chat reply, whole (message.tool_calls) and streamed (delta.tool_calls).

A streamed reply sends its plain text as it comes, and holds back what may become a call (the
parser's ``content_end``: a reply starting with "{" in the generic and Llama formats, from
``<tool_call>`` on in the Hermes one). When the choice finishes, the whole reply is parsed once,
as a non-streamed one is, and each call goes out whole in one delta: ``index``, ``id``,
``type``, ``function.name`` and ``function.arguments`` together, which the ``openai`` client
accumulates as it does fragments. What was held back and is not a call is sent then as content.
"""

from __future__ import annotations

import uuid

from engine.structured.tool_parsers import ParsedCall, ToolParser


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_reply(
    parser: ToolParser, text: str, parallel: bool
) -> tuple[str | None, list[ParsedCall]]:
    """A reply's content and calls (at most one when parallel tool calls are off)."""
    content, calls = parser.parse(text)
    if calls and not parallel:
        calls = calls[:1]
    return content, calls


def calls_json(calls: list[ParsedCall], streamed: bool = False) -> list[dict]:
    out = []
    for i, c in enumerate(calls):
        entry = {
            "id": call_id(),
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        out.append({"index": i, **entry} if streamed else entry)
    return out


def finish_reason(reason: str | None, calls: list[ParsedCall]) -> str | None:
    """OpenAI's "tool_calls" when the reply ended on its own with calls."""
    return "tool_calls" if calls and reason == "stop" else reason


class ToolCallStream:
    """One streamed choice: its text so far, and how much of it went out as content."""

    def __init__(self, parser: ToolParser, parallel: bool) -> None:
        self.parser = parser
        self.parallel = parallel
        self.text = ""
        self.sent = 0

    def feed(self, new_text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        """The content to send now, and (when ``final``) the reply's calls."""
        self.text += new_text
        if not final:
            end = max(self.sent, self.parser.content_end(self.text))
            out, self.sent = self.text[self.sent : end], end
            return out, []
        content, calls = parse_reply(self.parser, self.text, self.parallel)
        rest = (content or "")[self.sent :] if calls else self.text[self.sent :]
        self.sent = len(self.text)
        return rest, calls
