"""The structured-output fields of an OpenAI request, and the one constraint they ask for.

Three ways to ask, as clients send them:

- OpenAI's ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}``, or
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``.
- vLLM's ``structured_outputs`` map, by its field names (``StructuredOutputsParams``): ``json``,
  ``json_object``, ``regex``, ``choice``, ``grammar``, ``disable_any_whitespace``. Its
  ``disable_fallback`` and ``disable_additional_properties`` are accepted: there is one backend
  and nothing to fall back to, and objects take only the properties their schema names unless it
  says ``additionalProperties``, which is what the latter asks. Its ``whitespace_pattern`` and
  ``structural_tag`` are refused (400 naming them); so is any other field.
- The ``guided_json``, ``guided_regex``, ``guided_choice`` and ``guided_grammar`` fields that
  vLLM had before ``structured_outputs`` (it dropped them): kept as aliases, since older clients
  still send them. ``guided_decoding_backend`` may say ``xgrammar`` or ``auto`` (ours);
  ``guided_whitespace_pattern`` is refused.

More than one of them in a request is a 400 naming them. A constraint that is invalid, over a
size cap or does not compile is a 400 whose ``param`` is the field the client sent, and whose
message names the place inside it (``response_format.json_schema.schema nests ...``).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from engine.errors import RequestError
from engine.server.errors import APIError
from engine.structured.params import StructuredOutputs

# Where, in the field the client sent, the constraint of each kind sits (for messages).
_PLACES = {
    "response_format": {"json": "response_format.json_schema.schema"},
    "text": {"json": "text.format.schema"},  # /v1/responses
    "guided_json": {"json": "guided_json"},
    "guided_regex": {"regex": "guided_regex"},
    "guided_choice": {"choice": "guided_choice"},
    "guided_grammar": {"grammar": "guided_grammar"},
}
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
BACKENDS = ("xgrammar", "auto")
_PREFIX = re.compile(r"^structured_outputs\.([a-z_]+)")


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class TextFormat(_Model):
    type: Literal["text"]


class JSONObjectFormat(_Model):
    type: Literal["json_object"]


class JSONSchemaSpec(_Model):
    name: str = Field(max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the output always matches the schema, strict or not


class JSONSchemaFormat(_Model):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


ResponseFormat = Annotated[
    TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")
]


class StructuredOutputsField(_Model):
    """vLLM's ``structured_outputs``: exactly one of json, json_object, regex, choice, grammar."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # True by default here (vLLM: False): compact JSON, see engine/structured/params.py.
    disable_any_whitespace: bool | None = None
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: SkipJsonSchema[Any] = None
    structural_tag: SkipJsonSchema[Any] = None

    def to_map(self) -> dict[str, Any]:
        """The map StructuredOutputs takes; a 400 for the fields this server does not do."""
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise APIError(
                    400,
                    f"structured_outputs.{name} is not supported by this server",
                    "structured_outputs",
                )
        out: dict[str, Any] = {}
        for name in ("json_object", "regex", "choice", "grammar", "disable_any_whitespace"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.json_ is not None:
            out["json"] = self.json_
        return out


class StructuredFields(_Model):
    """The request fields that ask for a constraint (mixed into both request bodies)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = Field(None, json_schema_extra={"deprecated": True})
    guided_regex: str | None = Field(None, json_schema_extra={"deprecated": True})
    guided_choice: list[str] | None = Field(None, json_schema_extra={"deprecated": True})
    guided_grammar: str | None = Field(None, json_schema_extra={"deprecated": True})
    guided_decoding_backend: str | None = Field(None, json_schema_extra={"deprecated": True})
    guided_whitespace_pattern: SkipJsonSchema[Any] = None

    def structured_outputs_constraint(self) -> tuple[StructuredOutputs | None, str | None]:
        """The constraint asked for and the field that asked (None, None: none). Raises
        APIError (400) naming the field."""
        raw = self._constraint_maps()
        if not raw:
            return None, None
        field, value = next(iter(raw.items()))
        try:
            return StructuredOutputs.from_dict(value), field
        except RequestError as exc:
            raise APIError(400, in_field(exc.message, field), field) from None

    @property
    def constraint_field(self) -> str | None:
        """The field that asks for a constraint (after structured_outputs_constraint)."""
        raw = self._given()
        return next(iter(raw), None)

    def _given(self) -> dict[str, Any]:
        given: dict[str, Any] = {}
        rf = self.response_format
        if rf is not None and rf.type != "text":
            given["response_format"] = rf
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs
        for name in _GUIDED:
            if getattr(self, name) is not None:
                given[name] = getattr(self, name)
        return given

    def _constraint_maps(self) -> dict[str, dict[str, Any]]:
        if self.guided_whitespace_pattern is not None:
            raise APIError(
                400,
                "guided_whitespace_pattern is not supported by this server (JSON whitespace is "
                "set by structured_outputs.disable_any_whitespace)",
                "guided_whitespace_pattern",
            )
        backend = self.guided_decoding_backend
        if backend is not None and backend not in BACKENDS:
            raise APIError(
                400,
                f"guided_decoding_backend must be one of {', '.join(BACKENDS)} (this server "
                f"compiles constraints with xgrammar), got {backend!r}",
                "guided_decoding_backend",
            )
        given = self._given()
        if len(given) > 1:
            names = ", ".join(given)
            raise APIError(
                400,
                f"give at most one structured-output constraint in a request; got {names}",
                next(iter(given)),
            )
        out = {}
        for field, value in given.items():
            if field == "response_format":
                out[field] = _format_map(value)
            elif field == "structured_outputs":
                out[field] = value.to_map()
            else:
                out[field] = {_GUIDED[field]: value}
        return out


def _format_map(rf: JSONObjectFormat | JSONSchemaFormat) -> dict[str, Any]:
    if isinstance(rf, JSONObjectFormat):
        return {"json_object": True}
    schema = rf.json_schema.schema_
    if schema is None:
        raise APIError(400, "response_format.json_schema.schema is required", "response_format")
    return {"json": schema}


def in_field(message: str, field: str | None) -> str:
    """A StructuredOutputs or compiler message ("structured_outputs.json nests ...") said of
    the field the client sent ("response_format.json_schema.schema nests ...")."""
    if field is None or field == "structured_outputs":
        return message

    def place(m: re.Match) -> str:
        return _PLACES.get(field, {}).get(m.group(1), field)

    return _PREFIX.sub(place, message, count=1)
