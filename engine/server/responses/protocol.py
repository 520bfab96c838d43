"""The body of ``POST /v1/responses``, as strict pydantic models, and its input items.

Unlike the chat and completions bodies (which ignore unknown fields, as OpenAI-compatible servers
do), a field this server does not know is a 400 naming it, and so is a field of OpenAI's API that
it does not implement (unless its value asks for nothing: ``include: []``, ``background: false``,
``truncation: "disabled"``...). The input items (``input`` as a list) are checked one by one
(``items``), so that an error names the item and the place inside it (``input.2.content.0.type``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.json_schema import SkipJsonSchema

from engine.server.errors import APIError

MAX_METADATA_KEYS = 16  # OpenAI's limits on metadata
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512

# Fields of OpenAI's API that this server does not implement, with the values that ask for
# nothing (accepted). Declared so that each is refused by name, and left out of the OpenAPI
# document.
UNSUPPORTED: dict[str, tuple] = {
    "background": (False,),
    "conversation": (),
    "prompt": (),
    "reasoning": (),
    "service_tier": ("auto", "default"),
    "max_tool_calls": (),
    "top_logprobs": (0,),
    "prompt_cache_key": (),
    "prompt_cache_retention": (),
    "prompt_cache_options": (),
    "context_management": ([],),
    "moderation": (),
    "image": (),
    "access_programs": (),
    "background_options": (),
    "include": ([],),
}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class TextFormatText(_Strict):
    type: Literal["text"]


class TextFormatJSONObject(_Strict):
    type: Literal["json_object"]


class TextFormatJSONSchema(_Strict):
    """``text.format`` of type json_schema: the output is JSON that matches ``schema``."""

    type: Literal["json_schema"]
    name: str = Field(max_length=256)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None  # the output always matches the schema, strict or not


class TextConfig(_Strict):
    format: TextFormatText | TextFormatJSONObject | TextFormatJSONSchema | None = Field(
        None, discriminator="type"
    )
    verbosity: SkipJsonSchema[Any] = None  # refused unless null: no model here reads it


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None  # refused when true: deltas are not padded here


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``. Unknown fields are collected (extra="allow") and refused by name in
    ``check_fields``, after the known ones are validated."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True
    previous_response_id: str | None = Field(None, max_length=256)
    metadata: dict[str, str] | None = None
    user: str | None = Field(None, max_length=512)
    safety_identifier: str | None = Field(None, max_length=512)
    truncation: Literal["disabled"] | None = None
    # vLLM's extension, as on the chat and completions routes: under --scheduling-policy
    # priority a lower value is served first; under fcfs anything but 0 is a 400 naming it.
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)
    background: SkipJsonSchema[Any] = None
    conversation: SkipJsonSchema[Any] = None
    prompt: SkipJsonSchema[Any] = None
    reasoning: SkipJsonSchema[Any] = None
    service_tier: SkipJsonSchema[Any] = None
    max_tool_calls: SkipJsonSchema[Any] = None
    top_logprobs: SkipJsonSchema[Any] = None
    prompt_cache_key: SkipJsonSchema[Any] = None
    prompt_cache_retention: SkipJsonSchema[Any] = None
    prompt_cache_options: SkipJsonSchema[Any] = None
    context_management: SkipJsonSchema[Any] = None
    moderation: SkipJsonSchema[Any] = None
    image: SkipJsonSchema[Any] = None
    access_programs: SkipJsonSchema[Any] = None
    background_options: SkipJsonSchema[Any] = None
    include: SkipJsonSchema[Any] = None

    def check_fields(self) -> None:
        """400 for an unknown field, an unsupported one, or a value out of its limits."""
        for name in self.model_extra or {}:
            raise APIError(400, f"{name} is not a field of /v1/responses requests", name)
        for name, no_ops in UNSUPPORTED.items():
            value = getattr(self, name)
            if value is not None and not any(value == ok for ok in no_ops):
                raise APIError(400, f"{name} is not supported by this server", name)
        if self.text is not None and self.text.verbosity is not None:
            raise APIError(400, "text.verbosity is not supported by this server", "text")
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            raise APIError(
                400,
                "stream_options.include_obfuscation is not supported by this server",
                "stream_options",
            )
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options requires stream to be true", "stream_options")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise APIError(
                400,
                f"max_output_tokens must be >= 1, got {self.max_output_tokens}",
                "max_output_tokens",
            )
        self._check_metadata()

    def _check_metadata(self) -> None:
        meta = self.metadata or {}
        if len(meta) > MAX_METADATA_KEYS:
            raise APIError(
                400,
                f"metadata holds {len(meta)} keys; the limit is {MAX_METADATA_KEYS}",
                "metadata",
            )
        for key, value in meta.items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
                raise APIError(
                    400,
                    f"metadata keys must be at most {MAX_METADATA_KEY_CHARS} characters and "
                    f"values at most {MAX_METADATA_VALUE_CHARS}; {key[:80]!r} is over",
                    "metadata",
                )

    @property
    def format(self):
        return None if self.text is None else self.text.format


# -- input items -----------------------------------------------------------------------------


class InputText(_Strict):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: SkipJsonSchema[Any] = None


class OutputText(_Strict):
    """An assistant's text, sent back: what it said is kept, its annotations are not read."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: str


_PARTS: dict[str, type[BaseModel]] = {
    "input_text": InputText,
    "output_text": OutputText,
    "refusal": Refusal,
}


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(_Strict):
    """A call an earlier response made (its output item, sent back)."""

    type: Literal["function_call"]
    call_id: str = Field(max_length=256)
    name: str
    arguments: str  # JSON text, as the response gave it
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Strict):
    """The result of a call: text, or a list of input_text parts."""

    type: Literal["function_call_output"]
    call_id: str = Field(max_length=256)
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem
_ITEMS: dict[str, type[BaseModel]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}


def parse_items(raw: str | list[dict[str, Any]]) -> list[Item]:
    """The request's ``input`` as items (a string is one user message)."""
    if isinstance(raw, str):
        return [MessageItem(role="user", content=raw)]
    items: list[Item] = []
    for i, data in enumerate(raw):
        kind = data.get("type", "message")
        model = _ITEMS.get(kind) if isinstance(kind, str) else None
        if model is None:
            raise APIError(
                400,
                f"input.{i}.type {kind!r} is not supported by this server (only "
                f"{', '.join(repr(k) for k in _ITEMS)})",
                "input",
            )
        item = validate(model, data, f"input.{i}", "input")
        if isinstance(item, MessageItem) and isinstance(item.content, list):
            parts(item.content, f"input.{i}.content")
        if isinstance(item, FunctionCallOutputItem) and isinstance(item.output, list):
            parts(item.output, f"input.{i}.output", ("input_text",))
        items.append(item)
    return items


def parts(raw: list[dict[str, Any]], where: str, kinds: tuple[str, ...] | None = None) -> str:
    """The text of a list of content parts (joined); 400 naming a part of another type."""
    kinds = kinds or tuple(_PARTS)
    texts = []
    for j, data in enumerate(raw):
        kind = data.get("type")
        if kind not in kinds:
            raise APIError(
                400,
                f"{where}.{j}.type {kind!r} is not supported by this server (only "
                f"{', '.join(repr(k) for k in kinds)})",
                "input",
            )
        part = validate(_PARTS[kind], data, f"{where}.{j}", "input")
        texts.append(part.refusal if isinstance(part, Refusal) else part.text)
    return "".join(texts)


def validate(model: type[BaseModel], data: dict[str, Any], where: str, param: str):
    """``model`` from ``data``; a 400 whose message names the place (``where.field``)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        e = exc.errors()[0]
        loc = ".".join(str(p) for p in e.get("loc", ()))
        place = f"{where}.{loc}" if loc else where
        if e.get("type") == "extra_forbidden":
            raise APIError(400, f"{place} is not a field this server knows", param) from None
        raise APIError(400, f"{place}: {e.get('msg')}", param) from None


# -- tools -----------------------------------------------------------------------------------


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # forced calls follow the schema whatever it says


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: str


def parse_tools(raw: list[dict[str, Any]] | None) -> list[FunctionTool] | None:
    if raw is None:
        return None
    out = []
    for i, data in enumerate(raw):
        kind = data.get("type")
        if kind != "function":
            raise APIError(
                400,
                f"tools.{i}.type {kind!r} is not supported by this server (only 'function')",
                "tools",
            )
        out.append(validate(FunctionTool, data, f"tools.{i}", "tools"))
    return out


def parse_tool_choice(raw: str | dict[str, Any] | None) -> str | FunctionChoice | None:
    if not isinstance(raw, dict):
        return raw
    if raw.get("type") != "function":
        raise APIError(
            400,
            f"tool_choice of type {raw.get('type')!r} is not supported by this server (only "
            "'none', 'auto', 'required' or a function)",
            "tool_choice",
        )
    return validate(FunctionChoice, raw, "tool_choice", "tool_choice")
