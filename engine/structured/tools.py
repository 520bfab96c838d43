"""OpenAI function tools: which tool-call format a chat template speaks, the conversation rendered
for it, and the grammar that forces a call when ``tool_choice`` asks for one.

Three formats, named as vLLM's ``--tool-call-parser`` names them (tool_parsers.py reads each):

- ``hermes`` (Qwen2/2.5/3, Hermes): the template renders ``tools`` itself and the model writes
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call.
- ``llama3_json`` (Llama 3.1/3.2/3.3): the template renders ``tools`` and the model writes
  ``{"name": ..., "parameters": {...}}`` (calls separated by ``; ``).
- ``generic``, for every other template (the default model's has no tools section), as
  llama.cpp's server does: the tool definitions go into the system message (merged with the
  request's own), and the reply is constrained to a call object
  ``{"tool_calls": [{"name": ..., "arguments": {...}}]}`` or, for ``"auto"``, plain text that
  does not start with ``{``. Earlier calls and their results are rendered in the same shape: an
  assistant turn with the call object as its content, and each result as a user turn
  ``{"tool_response": {"tool_call_id": ..., "name": ..., "content": ...}}``.

``tool_choice`` ``"required"`` and a named function are grammars in every format (each
function's ``parameters`` schema enforced, at most one call when ``parallel_tool_calls`` is
false); ``"auto"`` is a grammar in the generic format only (a call or text), and parsed after the
fact in the others; ``"none"`` renders no tools and constrains nothing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from engine.errors import RequestError
from engine.structured.params import StructuredOutputs

FORMATS = ("hermes", "llama3_json", "generic")
MAX_TOOLS = 128  # as OpenAI caps a request's tools
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments; None: no arguments

    @property
    def schema(self) -> dict:
        return self.parameters if self.parameters is not None else EMPTY_PARAMETERS

    def openai(self) -> dict:
        """The OpenAI shape templates expect: {"type": "function", "function": {...}}."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.schema
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolRequest:
    """What a request asked: its tools, ``choice`` ("auto", "required" or a function's name;
    "none" is no ToolRequest at all) and whether several calls may come in one reply."""

    tools: tuple[Tool, ...]
    choice: str
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def allowed(self) -> tuple[Tool, ...]:
        if self.choice in ("auto", "required"):
            return self.tools
        return tuple(t for t in self.tools if t.name == self.choice)


# -- which format ------------------------------------------------------------------------------


def template_uses_tools(variables: set[str]) -> bool:
    """Whether a template (given the variables it reads) renders a ``tools`` list."""
    return "tools" in variables


def detect_format(template: str | None, variables: set[str]) -> str:
    """The tool-call format of a chat template: the model family's when its template renders
    ``tools`` in a format we parse, else "generic"."""
    if not template or not template_uses_tools(variables):
        return "generic"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or ("ipython" in template and '"parameters"' in template):
        return "llama3_json"
    return "generic"


# -- the constraint ------------------------------------------------------------------------------


def constraint(fmt: str, req: ToolRequest) -> StructuredOutputs | None:
    """The grammar the reply must match, or None (an "auto" reply the parser reads as it is).
    A tool's ``parameters`` that xgrammar cannot read is a RequestError naming the tool."""
    tools = req.allowed()
    if fmt == "generic" or req.forced:
        check_schemas(req.tools)
    if fmt == "generic":
        if not req.forced:
            return StructuredOutputs(grammar=_generic_auto_grammar(req.tools, req.parallel))
        return StructuredOutputs(json=generic_calls_schema(tools, req.parallel))
    if not req.forced:
        return None
    if fmt == "hermes":
        begin, key, end, sep = '<tool_call>\n{"name": "', "arguments", "}\n</tool_call>", "\n"
    else:
        begin, key, end, sep = '{"name": "', "parameters", "}", "; "
    tags = [
        {
            "type": "tag",
            "begin": f'{begin}{t.name}", "{key}": ',
            "content": {"type": "grammar", "grammar": _json_ebnf(t.schema)},
            "end": end,
        }
        for t in tools
    ]
    fmt_tag = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": sep,
        "at_least_one": True,
        "stop_after_first": not req.parallel,
    }
    return StructuredOutputs(grammar=_structural_tag_ebnf(fmt_tag))


def check_schemas(tools: tuple[Tool, ...]) -> None:
    import xgrammar as xgr

    for i, t in enumerate(tools):
        try:
            xgr.Grammar.from_json_schema(json.dumps(t.schema), any_whitespace=False)
        except Exception as exc:  # xgrammar's errors are RuntimeErrors with the reason
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            reason = re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", lines[0])
            raise RequestError(
                f"tools.{i}.function.parameters is not a JSON schema this server can compile: "
                f"{reason}",
                "tools",
            ) from None


def generic_calls_schema(tools: tuple[Tool, ...], parallel: bool) -> dict:
    """The JSON schema of a generic-format reply that calls ``tools``."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.schema},
            "required": ["name", "arguments"],
        }
        for t in tools
    ]
    array: dict[str, Any] = {
        "type": "array",
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        "minItems": 1,
    }
    if not parallel:
        array["maxItems"] = 1
    return {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"]}


def _generic_auto_grammar(tools: tuple[Tool, ...], parallel: bool) -> str:
    """A generic call object, or text that does not start with "{" or whitespace."""
    import xgrammar as xgr

    calls = xgr.Grammar.from_ebnf(_json_ebnf(generic_calls_schema(tools, parallel)))
    text = xgr.Grammar.from_ebnf("root ::= [^{ \\t\\r\\n] [^]*")
    return str(xgr.Grammar.union(calls, text))


def _json_ebnf(schema: dict) -> str:
    """The schema's grammar, writing JSON as the models do (``{"a": 1, "b": 2}``): no other
    whitespace, so that a small model cannot spend its tokens on it."""
    import xgrammar as xgr

    return str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))


def _structural_tag_ebnf(fmt: dict) -> str:
    import xgrammar as xgr

    return str(xgr.Grammar.from_structural_tag({"type": "structural_tag", "format": fmt}))


# -- rendering -----------------------------------------------------------------------------------


def generic_system_prompt(req: ToolRequest) -> str:
    tools = [t.openai()["function"] for t in req.tools]
    lines = [
        "You can call the following tools (functions). Each has a name, a description and a "
        "JSON schema of its arguments:",
        json.dumps(tools, ensure_ascii=False),
        "To call tools, reply with only a JSON object of this form and nothing else:",
        '{"tool_calls": [{"name": "<tool name>", "arguments": {<arguments>}}]}',
    ]
    if not req.parallel:
        lines.append("Call one tool at a time.")
    if req.choice == "auto":
        lines.append("If no tool is needed, answer in plain text instead.")
    elif req.choice == "required":
        lines.append("You must call at least one tool.")
    else:
        lines.append(f"You must call the tool {req.choice}.")
    lines.append("Tool results come back as tool_response objects.")
    return "\n".join(lines)


def render_messages(
    fmt: str, messages: list[dict], req: ToolRequest | None
) -> tuple[list[dict], dict]:
    """The messages and extra template arguments (``tools``) for the chat template.

    ``messages`` are OpenAI-shaped dicts (as ChatMessage.as_template_dict makes them). A template
    with its own tool format gets them as they are (``tool_calls`` with each call's arguments
    parsed to a map, as vLLM and transformers pass them) and ``tools``; otherwise the calls and
    results are rewritten in the generic format and the tools described in the system message.
    """
    if fmt != "generic":
        kwargs = {"tools": [t.openai() for t in req.tools]} if req is not None else {}
        return messages, kwargs
    out: list[dict] = []
    names: dict[str, str] = {}  # a call's id -> its function's name
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = call.get("function") or {}
                if call.get("id"):
                    names[call["id"]] = fn.get("name", "")
                calls.append({"name": fn.get("name"), "arguments": fn.get("arguments")})
            content = json.dumps({"tool_calls": calls}, ensure_ascii=False)
            if m.get("content"):
                content = m["content"] + "\n" + content
            out.append({"role": "assistant", "content": content})
        elif m["role"] == "tool":
            call_id = m.get("tool_call_id")
            response = {
                "tool_call_id": call_id,
                "name": m.get("name") or names.get(call_id or "", None),
                "content": m.get("content", ""),
            }
            line = json.dumps({"tool_response": response}, ensure_ascii=False)
            if out and out[-1].get("tool_results"):  # consecutive results: one user turn
                out[-1]["content"] += "\n" + line
            else:
                out.append({"role": "user", "content": line, "tool_results": True})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("tool_results", None)
    if req is not None:
        prompt = generic_system_prompt(req)
        if out and out[0]["role"] in ("system", "developer"):
            first = dict(out[0])
            first["content"] = (first.get("content") or "") + "\n\n" + prompt
            out[0] = first
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}
