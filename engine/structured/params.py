"""What a request's output must match: one structured-output constraint (vLLM's
``StructuredOutputsParams``, by the same field names).

Exactly one of ``json`` (a JSON schema), ``json_object`` (any JSON object), ``regex``, ``choice``
(one of these strings) or ``grammar`` is set. A grammar is EBNF in the GBNF dialect that
llama.cpp and xgrammar read (rules with ``::=``), or Lark's (rules with ``:``), as vLLM takes.
The schema is kept as JSON text, its key order unchanged (the order of a schema's properties is
the order the output writes them in), so that the value is hashable and is the compile cache's
key. Sizes are capped here (the MAX_ constants): a constraint over them is refused, naming the
field and the limit, before anything compiles it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from engine.errors import RequestError

# Caps on what a request may ask to compile: each names the field it checks.
MAX_SCHEMA_CHARS = 65_536  # json, as compact JSON text
MAX_SCHEMA_DEPTH = 32  # nesting of objects and arrays in the schema document
MAX_REGEX_CHARS = 4_096
MAX_GRAMMAR_CHARS = 65_536
MAX_CHOICES = 1_024
MAX_CHOICE_CHARS = 65_536  # all choices together
_TOO_DEEP = f"structured_outputs.json nests deeper than the limit of {MAX_SCHEMA_DEPTH} levels"
KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _refused(message: str) -> RequestError:
    """The error for a constraint that is not valid: the request's field is structured_outputs
    (the servers name the field the client sent, when another asked for it)."""
    return RequestError(message, "structured_outputs")


@dataclass(frozen=True)
class StructuredOutputs:
    """One constraint. ``disable_any_whitespace`` (vLLM's name) keeps JSON output compact:
    single spaces after ``:`` and ``,``, no newlines. It is True by default here, unlike vLLM: a
    small model sampled at temperature 1 otherwise can spend its whole ``max_tokens`` on the
    whitespace the JSON grammar allows between tokens. Schemas compile in strict mode (xgrammar's
    default, as vLLM uses it): an object takes only the properties its schema names unless it
    says ``additionalProperties``."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            object.__setattr__(self, "json", canonical_schema(self.json))
        elif isinstance(self.json, str):
            object.__setattr__(self, "json", canonical_schema(_parse_schema(self.json)))
        if self.choice is not None and not isinstance(self.choice, tuple):
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                raise _refused(
                    f"structured_outputs.choice must be a list of strings, got {self.choice!r}"
                )
            object.__setattr__(self, "choice", tuple(self.choice))
        self._validate()

    def _validate(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise _refused(
                "structured_outputs must set exactly one of json, json_object, regex, choice, "
                f"grammar; got {', '.join(given) or 'none'}"
            )
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise _refused(f"structured_outputs.{name} must be a boolean")
        if self.json is not None:
            _check_len("json", self.json, MAX_SCHEMA_CHARS)
            depth = _depth(json.loads(self.json))
            if depth > MAX_SCHEMA_DEPTH:
                raise _refused(
                    f"structured_outputs.json nests {depth} levels deep; the limit is "
                    f"{MAX_SCHEMA_DEPTH}"
                )
        if self.regex is not None:
            _check_str("regex", self.regex, MAX_REGEX_CHARS)
        if self.grammar is not None:
            _check_str("grammar", self.grammar, MAX_GRAMMAR_CHARS)
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise _refused("structured_outputs.choice must be a non-empty list of strings")
            if len(self.choice) > MAX_CHOICES:
                raise _refused(
                    f"structured_outputs.choice has {len(self.choice)} entries; the limit is "
                    f"{MAX_CHOICES}"
                )
            _check_len("choice", "".join(self.choice), MAX_CHOICE_CHARS)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def to_dict(self) -> dict[str, Any]:
        """The set fields as plain values (the wire form): json as text, choice as a list."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, raw: object) -> StructuredOutputs:
        """From an untrusted map (a request body, a socket): unknown fields are refused."""
        if isinstance(raw, StructuredOutputs):
            return raw
        if not isinstance(raw, dict):
            raise _refused(f"structured_outputs must be a map, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in raw if k not in known)
        if unknown:
            raise _refused(
                f"structured_outputs has unknown fields: {', '.join(unknown)} "
                f"(known: {', '.join(sorted(known))})"
            )
        return cls(**raw)


def canonical_schema(schema: Any) -> str:
    """A schema (a dict, or True for any JSON value) as compact JSON text."""
    if not isinstance(schema, (dict, bool)):
        raise _refused(
            f"structured_outputs.json must be a JSON schema (an object), got "
            f"{type(schema).__name__}"
        )
    try:
        # Key order kept: a schema's property order is the order the output writes them in.
        return json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except RecursionError:
        raise _refused(_TOO_DEEP) from None
    except (TypeError, ValueError) as exc:
        raise _refused(f"structured_outputs.json is not valid JSON: {exc}") from None


def _parse_schema(text: str) -> Any:
    _check_len("json", text, MAX_SCHEMA_CHARS)
    try:
        return json.loads(text)
    except RecursionError:
        raise _refused(_TOO_DEEP) from None
    except ValueError as exc:
        raise _refused(f"structured_outputs.json is not valid JSON: {exc}") from None


def _check_str(name: str, value: object, limit: int) -> None:
    if not isinstance(value, str) or not value:
        raise _refused(f"structured_outputs.{name} must be a non-empty string")
    _check_len(name, value, limit)


def _check_len(name: str, text: str, limit: int) -> None:
    if len(text) > limit:
        raise _refused(f"structured_outputs.{name} is {len(text)} characters; the limit is {limit}")


def _depth(value: Any) -> int:
    """Nesting depth of a JSON document, without recursion (a deep one must not blow the
    stack before it is refused)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict):
            deepest = max(deepest, d)
            todo.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            deepest = max(deepest, d)
            todo.extend((x, d + 1) for x in v)
    return deepest
