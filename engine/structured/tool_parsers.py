"""Tool calls read back from a model's reply: one parser per format (tools.py describes them),
named as vLLM's ``--tool-call-parser`` names them.

``parse(text)`` splits a whole reply into its plain content (None when there is none) and its
calls. A reply that looks like a call but does not parse is content, unchanged: the client sees
what the model wrote. ``content_end(text)`` is for streaming: how much of a partial reply is
surely content, so that a stream can send it while it holds back what may become a call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI's function.arguments


def _call(obj: object, key: str) -> ParsedCall | None:
    """A call from a decoded {"name": ..., key: {...}}, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolParser:
    name = ""

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        raise NotImplementedError


class JSONStartParser(ToolParser):
    """Formats whose calls are the whole reply, starting with "{" (after ``prefix``)."""

    prefix = ""

    def content_end(self, text: str) -> int:
        head = text.lstrip()
        if not head:
            return 0
        if self.prefix and self.prefix.startswith(head[: len(self.prefix)]):
            return 0
        return 0 if head.startswith("{") else len(text)

    def _body(self, text: str) -> str | None:
        body = text.strip()
        if self.prefix and body.startswith(self.prefix):
            body = body[len(self.prefix) :].lstrip()
        return body if body.startswith("{") else None


class GenericParser(JSONStartParser):
    """``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}``, else plain text."""

    name = "generic"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = self._body(text)
        if body is None:
            return text or None, []
        try:
            obj = json.loads(body)
        except ValueError:
            return text, []
        raw = obj.get("tool_calls") if isinstance(obj, dict) else None
        calls = [_call(c, "arguments") for c in raw] if isinstance(raw, list) else []
        if not calls or None in calls:
            return text, []
        return None, calls


class Llama3JSONParser(JSONStartParser):
    """Llama 3.x: ``<|python_tag|>`` (optional), then ``{"name": ..., "parameters": {...}}``,
    several separated by ``;``."""

    name = "llama3_json"
    prefix = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = self._body(text)
        if body is None:
            return text or None, []
        decoder = json.JSONDecoder()
        calls, at = [], 0
        try:
            while at < len(body):
                obj, at = decoder.raw_decode(body, at)
                call = _call(obj, "parameters")
                if call is None:
                    return text, []
                calls.append(call)
                rest = body[at:].lstrip()
                if rest.startswith(";"):
                    rest = rest[1:].lstrip()
                elif rest:
                    return text, []
                at = len(body) - len(rest)
        except ValueError:
            return text, []
        return None, calls


class HermesParser(ToolParser):
    """Qwen2/3, Hermes: text, then ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    blocks (the last one may lack its end tag: the reply ran out)."""

    name = "hermes"
    start = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        at = text.find(self.start)
        if at < 0:
            return text or None, []
        calls = []
        for body in self._block.findall(text, at):
            try:
                call = _call(json.loads(body), "arguments")
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        content = text[:at].rstrip()
        return content or None, calls

    def content_end(self, text: str) -> int:
        at = text.find(self.start)
        if at < 0:  # hold back what may be the start of the tag
            at = len(text)
            for k in range(min(len(self.start) - 1, len(text)), 0, -1):
                if self.start.startswith(text[-k:]):
                    at = len(text) - k
                    break
        return len(text[:at].rstrip())


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JSONParser, GenericParser)
}


def get_parser(name: str) -> ToolParser:
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"tool call parser {name!r} is unknown (known: {', '.join(sorted(PARSERS))})"
        ) from None
