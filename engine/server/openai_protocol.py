"""Request bodies of the OpenAI-compatible API, as strict pydantic models.

Strict: a wrong JSON type is a 400 naming the field, never a silent coercion ("1" is not 1,
true is not 1). Unknown fields are ignored, as OpenAI-compatible servers do, so clients that
send extra options still work. Ranges are checked by ``SamplingParams`` (one place, one message
style); here only what SamplingParams cannot see.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.json_schema import SkipJsonSchema

from engine.errors import RequestError
from engine.sampling_params import SamplingParams
from engine.server.errors import APIError
from engine.server.openai_structured import StructuredFields
from engine.structured.tools import MAX_TOOLS, TOOL_NAME, Tool, ToolRequest

MAX_N = 128  # choices per prompt, as OpenAI caps n
MAX_SEQUENCES = 1024  # prompts x n in one request
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1 - MAX_N  # the engine seeds choice i with seed + i


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


# Options that OpenAI or vLLM define and this server does not implement. Each is declared so
# that a request using it gets a 400 naming it: ignoring it silently (a 200 that did not do
# what was asked) is the worst answer. A value that asks for nothing (None, tool_choice "none",
# an empty tools list) is accepted. They are left out of the OpenAPI document.
_UNSUPPORTED = (
    "tools functions function_call tool_choice parallel_tool_calls grammar json_schema"
).split()
_NO_OPS: dict[str, tuple] = {
    "tools": ([],),
    "functions": ([],),
    "tool_choice": ("none",),
}


def reject_unsupported(model: BaseModel, names: list[str]) -> None:
    for name in names:
        if name in getattr(model, "_served", ()):  # a subclass that serves it (tools on chat)
            continue
        value = getattr(model, name, None)
        if value is None or any(value == ok for ok in _NO_OPS.get(name, ())):
            continue
        raise APIError(400, f"{name} is not supported by this server", name)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict, StructuredFields):
    """Fields shared by /v1/completions and /v1/chat/completions (the structured-output ones:
    openai_structured.py)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    request_id: str | None = Field(None, max_length=256)
    cache_salt: str | None = Field(None, max_length=256)
    tools: SkipJsonSchema[Any] = None
    functions: SkipJsonSchema[Any] = None
    function_call: SkipJsonSchema[Any] = None
    tool_choice: SkipJsonSchema[Any] = None
    parallel_tool_calls: SkipJsonSchema[Any] = None
    grammar: SkipJsonSchema[Any] = None
    json_schema: SkipJsonSchema[Any] = None
    # vLLM's extension: logprobs of the prompt's tokens, and this many alternatives per token.
    prompt_logprobs: int | None = None
    # vLLM's extension: under --scheduling-policy priority, a lower value is served first (and
    # preempted last); under fcfs anything but 0 is a 400 (the engine checks it).
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)

    def _check_unsupported(self) -> None:
        reject_unsupported(self, _UNSUPPORTED)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server", "logit_bias")
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(
                400, "prompt_logprobs is not available when stream is true", "prompt_logprobs"
            )
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(
                400, f"best_of must equal n ({self.n}) when given, got {self.best_of}", "best_of"
            )

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """SamplingParams for this request; raises APIError or RequestError naming a bad
        field."""
        self._check_unsupported()
        given = {
            name: getattr(self, name)
            for name in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
            )
            if getattr(self, name) is not None
        }
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        structured_outputs, _ = self.structured_outputs_constraint()
        return SamplingParams(
            n=self.n,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=structured_outputs,
            **given,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: one text or token-id list per prompt."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise RequestError("prompt must not be empty", "prompt")
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as the reply gave it


class ToolCall(_Strict):
    """A call an earlier assistant turn made (its reply's message.tool_calls, sent back)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # every call is checked against parameters anyway when forced


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's, sent back in a round trip
    tool_call_id: str | None = None  # a tool message's: the call it answers

    @model_validator(mode="before")
    @classmethod
    def _only_text_parts(cls, data):
        # Name the part type we do not take, instead of pydantic's union complaint
        # ("content.str: Input should be a valid string").
        content = data.get("content") if isinstance(data, dict) else None
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(
                        f"content parts of type {kind!r} are not supported (only 'text')"
                    )
        return data

    def text(self) -> str:
        content = self.content
        if isinstance(content, list):
            return "".join(part.text for part in content)
        return content or ""

    def as_template_dict(self) -> dict:
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            # Templates write the arguments as JSON themselves (tojson): give them the map.
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {"name": c.function.name, "arguments": _arguments(c)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _arguments(call: ToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, str | int | float | bool | None] | None = None
    echo: SkipJsonSchema[Any] = None
    chat_template: SkipJsonSchema[Any] = None
    continue_final_message: SkipJsonSchema[Any] = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    _served: ClassVar[frozenset[str]] = frozenset(("tools", "tool_choice", "parallel_tool_calls"))

    def tool_request(self) -> ToolRequest | None:
        """The tools this request offers and how it asks for calls; None: no tools (none given,
        or tool_choice "none")."""
        return tool_request(self.tools, self.tool_choice, self.parallel_tool_calls)

    def engine_logprobs(self) -> int | None:
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= 20:
                raise APIError(
                    400, f"top_logprobs must be in [0, 20], got {self.top_logprobs}", "top_logprobs"
                )
            if not self.logprobs:
                raise APIError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def check_chat_unsupported(self) -> None:
        for name in ("echo", "continue_final_message"):
            if getattr(self, name) not in (None, False):
                raise APIError(400, f"{name} is not supported by this server", name)
        if self.chat_template is not None:
            raise APIError(
                400,
                "chat_template in a request is not accepted: the model's own template is used",
                "chat_template",
            )
        check_tool_messages(self.messages)


def tool_request(
    tools: list[ChatTool] | None,
    choice: str | NamedToolChoice | None,
    parallel_tool_calls: bool | None,
    where: str = "function.",
) -> ToolRequest | None:
    """The ToolRequest of a request's tools, tool_choice and parallel_tool_calls; None: no tools
    (none given, or tool_choice "none"). ``where``: the path from a tool to its name in the
    request's own shape, for messages ("function." on chat, "" on /v1/responses)."""
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice requires tools", "tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"tools holds {len(tools)} tools; the limit is {MAX_TOOLS}", "tools")
    out, seen = [], set()
    for i, t in enumerate(tools):
        name = t.function.name
        if not TOOL_NAME.fullmatch(name):
            raise APIError(
                400,
                f"tools.{i}.{where}name must be 1 to 64 letters, digits, _ or -, got {name!r}",
                "tools",
            )
        if name in seen:
            raise APIError(400, f"tools.{i}.{where}name {name!r} is given twice", "tools")
        seen.add(name)
        kind = (t.function.parameters or {}).get("type", "object")
        if kind != "object":
            raise APIError(
                400,
                f"tools.{i}.{where}parameters must be the JSON schema of an object "
                f'(its arguments), got "type": {json.dumps(kind)}',
                "tools",
            )
        out.append(Tool(name, t.function.description, t.function.parameters))
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        choice = choice.function.name
        if choice not in seen:
            raise APIError(
                400, f"tool_choice names {choice!r}, which is not in tools", "tool_choice"
            )
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    return ToolRequest(tuple(out), choice or "auto", parallel)


def check_tool_messages(messages: list[ChatMessage]) -> None:
    """tool_calls only on an assistant's message, tool_call_id on (and only on) a tool's."""
    for i, m in enumerate(messages):
        if m.tool_calls is not None and m.role != "assistant":
            raise APIError(
                400, f"messages.{i}.tool_calls is only allowed on an assistant message", "messages"
            )
        if (m.tool_call_id is not None) != (m.role == "tool"):
            message = (
                f"messages.{i}.tool_call_id is required on a tool message"
                if m.role == "tool"
                else f"messages.{i}.tool_call_id is only allowed on a tool message"
            )
            raise APIError(400, message, "messages")


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
