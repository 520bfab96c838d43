"""One codec for every socket: typed messages as a msgpack header map plus raw frames.

A schema is a set of frozen dataclasses (subclasses of ``Message``) whose fields are declared
once, with their types and limits; a ``Codec`` names the header key that holds each message's
kind, the size limits, and its error class. On the wire, frame 0 is ``{TAG: kind, field: value,
...}`` and frames 1.. are the message's ``frames`` (bulk bytes go there, never through msgpack's
object model). Nothing is ever unpickled.

Field types: ``bool``, ``int``, ``float`` (an int is accepted), ``str``, ``bytes``, ``dict``,
``None``, ``list[T]``, unions of those, and limits as ``Annotated[T, Len(lo, hi)]`` (items,
characters or bytes) or ``Annotated[T, Range(lo, hi)]``. Rules between fields are the message's
``problem()``, its data frames its ``expected_frames()``.

``decode`` checks everything a peer could get wrong (the sizes and number of frames, the header,
the kind, every field's type and limits, the rules between fields, the number of data frames) and
raises the codec's error class, a ``CodecError`` naming the field, and nothing else.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, ClassVar

import msgpack

Buffer = bytes | bytearray | memoryview


class CodecError(ValueError):
    """A frame that is not a valid message. ``field``: the field at fault, if one is;
    ``header``: the decoded header map, if it was one (to echo a call id)."""

    def __init__(self, message: str, field: str | None = None, header: dict | None = None):
        super().__init__(message)
        self.field = field
        self.header = header


@dataclass(frozen=True)
class Len:
    """A field's length limits: items of a list, characters of a str, bytes of bytes."""

    lo: int = 0
    hi: int = 2**63

    def problem(self, value: typing.Sized) -> str | None:
        n = len(value)
        if self.lo <= n <= self.hi:
            return None
        unit = {list: "items", str: "characters"}.get(type(value), "bytes")
        if self.lo == self.hi:
            return f"has {n} {unit}, must have {self.lo}"
        if n > self.hi:
            return f"has {n} {unit}, the limit is {self.hi}"
        return f"has {n} {unit}, needs at least {self.lo}"


@dataclass(frozen=True)
class Range:
    """A number's limits, both included."""

    lo: float
    hi: float

    def problem(self, value: float) -> str | None:
        if self.lo <= value <= self.hi:
            return None
        return f"is {_short(value)}, must be in [{self.lo}, {self.hi}]"


@typing.dataclass_transform(kw_only_default=False, field_specifiers=(field,))
@dataclass(frozen=True)
class Message:
    """A message of a schema. A subclass is a frozen dataclass without a decorator, and names its
    kind in its class statement: ``class Abort(Message, kind="abort"):``."""

    KIND: ClassVar[str] = ""
    frames: tuple[Buffer, ...] = field(default=(), kw_only=True)

    def __init_subclass__(cls, kind: str = "", **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if kind:
            cls.KIND = kind
        dataclass(frozen=True)(cls)

    def expected_frames(self) -> int:
        """How many data frames follow the header."""
        return 0

    def problem(self) -> str | None:
        """What breaks a rule between fields, or None."""
        return None


@dataclass(frozen=True)
class _Field:
    name: str
    hint: object
    required: bool  # on the wire: no default, or the codec wants every field
    none_default: bool  # its default is None (left out of a header when it is None)


class Codec:
    """Encodes and decodes the messages of one schema.

    ``tag``: the header key naming the kind; ``messages``: kind -> class; ``error``: the
    CodecError subclass decode raises. ``defaults_optional``: a field with a default may be
    missing from a header (and one that is None by default is left out when it is None);
    else every field must be present. ``ignore_unknown``: header keys that are no field are
    ignored (else refused). The header refuses msgpack bin values unless a field is bytes.
    """

    def __init__(
        self,
        tag: str,
        messages: dict[str, type[Message]],
        *,
        error: type[CodecError] = CodecError,
        max_header_bytes: int,
        max_frame_bytes: int,
        max_frames: int,
        defaults_optional: bool = True,
        ignore_unknown: bool = False,
    ) -> None:
        self.tag = tag
        self.messages = dict(messages)
        self.error = error
        self.max_header_bytes = max_header_bytes
        self.max_frame_bytes = max_frame_bytes
        self.max_frames = max_frames
        self.ignore_unknown = ignore_unknown
        self._kinds = {cls: kind for kind, cls in self.messages.items()}
        self._fields = {cls: _fields_of(cls, defaults_optional) for cls in self._kinds}
        self._names = {cls: {f.name for f in fs} for cls, fs in self._fields.items()}
        self._bin_ok = any(_admits_bytes(f.hint) for fs in self._fields.values() for f in fs)
        self._defaults_optional = defaults_optional

    def kind(self, msg: Message) -> str:
        return self._kinds[type(msg)]

    def encode(self, msg: Message) -> list:
        """The frames of ``msg``: its msgpack header, then its data frames (not copied)."""
        header: dict = {self.tag: self._kinds[type(msg)]}
        for f in self._fields[type(msg)]:
            value = getattr(msg, f.name)
            if not (value is None and f.none_default and self._defaults_optional):
                header[f.name] = value
        return [msgpack.packb(header, use_bin_type=True), *msg.frames]

    def decode(self, frames: Sequence, check_frames: bool = True) -> Message:
        """The message in ``frames`` (bytes or buffers; data frames come back as memoryviews).
        ``check_frames=False`` decodes a header alone (its data frames are read separately)."""
        err = self.error
        if not frames:
            raise err("empty message: no header frame")
        if len(frames) > self.max_frames:
            raise err(f"too many frames: {len(frames)}, the limit is {self.max_frames}")
        views = [memoryview(f).cast("B") for f in frames]
        if views[0].nbytes > self.max_header_bytes:
            raise err(
                f"header of {views[0].nbytes} bytes is over the limit of {self.max_header_bytes}"
            )
        for i, v in enumerate(views[1:], 1):
            if v.nbytes > self.max_frame_bytes:
                raise err(f"frame {i} of {v.nbytes} bytes is over the limit {self.max_frame_bytes}")
        try:  # the buffer bounds every declared length: a huge one fails, allocates nothing
            header = msgpack.unpackb(
                views[0],
                raw=False,
                strict_map_key=True,
                max_bin_len=-1 if self._bin_ok else 0,
                max_ext_len=0,
            )
        except msgpack.exceptions.StackError:
            raise err("header nests deeper than msgpack's limit (1024 levels)") from None
        except Exception as exc:  # msgpack raises several types for garbage
            raise err(f"header is not valid msgpack: {type(exc).__name__}: {exc}") from None
        if not isinstance(header, dict):
            raise err(f"header must be a map, got {type(header).__name__}")
        kind = header.get(self.tag)
        cls = self.messages.get(kind) if isinstance(kind, str) else None  # a list is unhashable
        if cls is None:
            raise err(
                f"unknown message type {_short(kind)}: {self.tag} must be one of "
                f"{', '.join(self.messages)}",
                self.tag,
                header,
            )
        kwargs = {}
        for f in self._fields[cls]:
            if f.name not in header:
                if f.required:
                    raise err(f"{kind}: field {f.name!r} is missing", f.name, header)
                continue
            value = header[f.name]
            what = problem(value, f.hint)
            if what is not None:
                raise err(f"{kind}: field {f.name!r} {what}", f.name, header)
            kwargs[f.name] = value
        if not self.ignore_unknown:
            extra = set(header) - self._names[cls] - {self.tag}
            if extra:
                raise err(f"{kind}: unknown fields {sorted(map(str, extra))}", None, header)
        msg = cls(**kwargs, frames=tuple(views[1:]))
        what = msg.problem()
        if what is not None:
            raise err(f"{kind}: {what}", None, header)
        if check_frames and len(msg.frames) != msg.expected_frames():
            raise err(
                f"{kind}: expected {msg.expected_frames()} data frame(s), got {len(msg.frames)}",
                None,
                header,
            )
        return msg


def problem(value: object, hint: object) -> str | None:
    """None when ``value`` fits the field type ``hint``, else what is wrong with it
    (``must be int, got str``, ``has 300 characters, the limit is 256``, ``item 2 ...``)."""
    if _is_union(hint):
        arms = [h for h in typing.get_args(hint) if _fits_type(value, h)]
        if not arms:
            return f"must be {describe(hint)}, got {_type_name(value)}"
        problems = [problem(value, h) for h in arms]
        return None if None in problems else problems[0]
    base, limits = _unwrap(hint)
    if not _fits_type(value, base):
        return f"must be {describe(hint)}, got {_type_name(value)}"
    for limit in limits:
        what = limit.problem(value)
        if what is not None:
            return what
    if typing.get_origin(base) is list:
        (item,) = typing.get_args(base)
        for i, v in enumerate(value):
            what = problem(v, item)
            if what is not None:
                return f"item {i} {what}"
    return None


def describe(hint: object) -> str:
    """A field type in words: ``int``, ``list[int]``, ``str or None`` (limits left out)."""
    if _is_union(hint):
        return " or ".join(describe(h) for h in typing.get_args(hint))
    base, _ = _unwrap(hint)
    if typing.get_origin(base) is list:
        return f"list[{describe(typing.get_args(base)[0])}]"
    return "None" if base is type(None) else getattr(base, "__name__", str(base))


_SCALARS: dict[object, typing.Callable[[object], bool]] = {
    type(None): lambda v: v is None,
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
    bytes: lambda v: isinstance(v, bytes),
    dict: lambda v: isinstance(v, dict),
}


def _fits_type(value: object, hint: object) -> bool:
    """The outer type only (no items, no limits)."""
    if _is_union(hint):
        return any(_fits_type(value, h) for h in typing.get_args(hint))
    base, _ = _unwrap(hint)
    if typing.get_origin(base) is list:
        return isinstance(value, list)
    return _SCALARS[base](value)


def _check_hint(hint: object) -> None:
    """A field type the codec cannot check is refused when the schema is built."""
    if _is_union(hint):
        for h in typing.get_args(hint):
            _check_hint(h)
        return
    base, limits = _unwrap(hint)
    if any(not isinstance(limit, Len | Range) for limit in limits):
        raise TypeError(f"unsupported limit in {hint!r}")
    if typing.get_origin(base) is list:
        _check_hint(typing.get_args(base)[0])
    elif base not in _SCALARS:
        raise TypeError(f"unsupported field type {hint!r}")


def _admits_bytes(hint: object) -> bool:
    if _is_union(hint):
        return any(_admits_bytes(h) for h in typing.get_args(hint))
    base, _ = _unwrap(hint)
    if typing.get_origin(base) is list:
        return _admits_bytes(typing.get_args(base)[0])
    return base is bytes


def _unwrap(hint: object) -> tuple[object, tuple]:
    if typing.get_origin(hint) is Annotated:
        base, *limits = typing.get_args(hint)
        return base, tuple(limits)
    return hint, ()


def _is_union(hint: object) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _fields_of(cls: type, defaults_optional: bool) -> list[_Field]:
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in dataclasses.fields(cls):
        if f.name == "frames":
            continue
        _check_hint(hints[f.name])
        has_default = f.default is not dataclasses.MISSING or (
            f.default_factory is not dataclasses.MISSING
        )
        required = not (has_default and defaults_optional)
        out.append(_Field(f.name, hints[f.name], required, has_default and f.default is None))
    return out


def _type_name(value: object) -> str:
    return type(value).__name__


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
