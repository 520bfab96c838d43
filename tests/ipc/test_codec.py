"""The one codec (engine/ipc/codec.py), on every schema built on it: each message kind round-trips;
every field with a wrong value, and every required field left out, is refused by name with the
schema's own error; the limits on frames (count, size), the header and field lengths hold."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Annotated

import msgpack
import pytest

from engine.cluster import messages as m
from engine.ipc import codec
from engine.ipc.codec import Codec, CodecError, Len, Range
from engine.kvstore.service import protocol as P
from engine.server import rpc_messages as r

CODECS = {"cluster": m.CODEC, "pool": P.CODEC, "rpc_requests": r.REQUESTS, "rpc_replies": r.REPLIES}


def example(hint: object) -> object:
    """A valid value of a field type (the smallest one its limits allow)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return example(typing.get_args(hint)[0])
    base, limits = (
        (typing.get_args(hint)[0], typing.get_args(hint)[1:])
        if typing.get_origin(hint) is Annotated
        else (hint, ())
    )
    lo = next((lim.lo for lim in limits), 0)
    if typing.get_origin(base) is list:
        return [example(typing.get_args(base)[0]) for _ in range(int(lo))]
    values = {bool: False, int: int(lo), float: float(lo), str: "s" * int(lo), dict: {}}
    return {bytes: b"x" * int(lo), type(None): None}.get(base, values.get(base))


WRONG = [object(), "text", 7, 2.5, True, None, [1], {"k": 1}, b"raw"]


def wrong(hint: object) -> object:
    """A msgpack-able value of another type than the field's."""
    for value in WRONG[1:]:
        if not codec._fits_type(value, hint):
            return value
    raise AssertionError(f"no wrong value for {hint}")


def sample(c: Codec, cls: type) -> codec.Message:
    """The smallest valid message of a kind, with the data frames it must carry."""
    fields = c._fields[cls]
    msg = cls(**{f.name: example(f.hint) for f in fields})
    needs = msg.expected_frames() if hasattr(msg, "expected_frames") else 0
    return dataclasses.replace(msg, frames=(b"x",) * needs) if needs else msg


KINDS = [(name, kind) for name, c in CODECS.items() for kind in c.messages]


@pytest.mark.parametrize("name, kind", KINDS)
def test_every_kind_round_trips(name, kind):
    c = CODECS[name]
    msg = sample(c, c.messages[kind])
    frames = c.encode(msg)
    assert msgpack.unpackb(frames[0])[c.tag] == kind
    assert c.decode(frames) == msg


FIELDS = [
    (name, kind, f.name)
    for name, c in CODECS.items()
    for kind, cls in c.messages.items()
    for f in c._fields[cls]
]


@pytest.mark.parametrize("name, kind, field", FIELDS)
def test_every_field_with_a_wrong_type_is_refused_by_name(name, kind, field):
    c = CODECS[name]
    header = msgpack.unpackb(c.encode(sample(c, c.messages[kind]))[0])
    hint = next(f.hint for f in c._fields[c.messages[kind]] if f.name == field)
    header[field] = wrong(hint)
    with pytest.raises(c.error) as info:
        c.decode([msgpack.packb(header, use_bin_type=True)])
    assert info.value.field == field or "not valid msgpack" in str(info.value)  # a bin, refused
    assert f"'{field}'" in str(info.value) or "not valid msgpack" in str(info.value)


@pytest.mark.parametrize("name, kind, field", FIELDS)
def test_every_required_field_left_out_is_refused_by_name(name, kind, field):
    c = CODECS[name]
    f = next(f for f in c._fields[c.messages[kind]] if f.name == field)
    header = msgpack.unpackb(c.encode(sample(c, c.messages[kind]))[0])
    header.pop(field, None)
    frames = [msgpack.packb(header, use_bin_type=True)]
    if not f.required:  # the default fills it
        default = next(d for d in dataclasses.fields(c.messages[kind]) if d.name == field)
        want = default.default_factory() if callable(default.default_factory) else default.default
        assert getattr(c.decode(frames), field) == want
        return
    with pytest.raises(c.error, match=f"'{field}' is missing") as info:
        c.decode(frames)
    assert info.value.field == field


def test_schema_errors_are_codec_errors_and_value_errors():
    assert issubclass(m.MessageError, CodecError) and issubclass(P.ProtocolError, CodecError)
    assert issubclass(CodecError, ValueError)


# -- a schema of its own, for the limits ---------------------------------------------------------


class Blob(codec.Message, kind="blob"):
    name: Annotated[str, Len(1, 8)]
    count: Annotated[int, Range(0, 10)]
    keys: Annotated[list[Annotated[bytes, Len(2, 2)]], Len(0, 3)]
    size: float | None = None

    def expected_frames(self) -> int:
        return self.count

    def problem(self) -> str | None:
        return "name must not be 'bad'" if self.name == "bad" else None


BLOBS = Codec("k", {"blob": Blob}, max_header_bytes=200, max_frame_bytes=16, max_frames=4)


def blob_header(**fields) -> bytes:
    return msgpack.packb({"k": "blob", "name": "n", "count": 0, "keys": [], **fields})


def test_frames_round_trip_as_buffers():
    msg = Blob("n", 2, [b"ab"], frames=(b"one", bytearray(b"two")))
    back = BLOBS.decode(BLOBS.encode(msg))
    assert back == msg and all(isinstance(f, memoryview) for f in back.frames)
    assert back.size is None and b"size" not in BLOBS.encode(msg)[0]  # None defaults stay out


@pytest.mark.parametrize(
    "frames, words",
    [
        ([], "empty message"),
        ([blob_header(count=4)] + [b"x"] * 4, "too many frames: 5, the limit is 4"),
        ([blob_header(count=1), b"x" * 17], "frame 1 of 17 bytes is over the limit 16"),
        ([blob_header(name="n" * 300)], "header of .* bytes is over the limit of 200"),
        ([blob_header(count=2), b"x"], "expected 2 data frame"),
        ([blob_header(count=0), b"x"], "expected 0 data frame"),
        ([blob_header(name="")], "'name' has 0 characters, needs at least 1"),
        ([blob_header(name="n" * 9)], "'name' has 9 characters, the limit is 8"),
        ([blob_header(count=11)], r"'count' is 11, must be in \[0, 10\]"),
        ([blob_header(count=True)], "'count' must be int, got bool"),
        ([blob_header(keys=[b"ab"] * 4)], "'keys' has 4 items, the limit is 3"),
        ([blob_header(keys=[b"ab", b"a"])], "'keys' item 1 has 1 bytes, must have 2"),
        ([blob_header(keys=[b"ab", "ab"])], "'keys' item 1 must be bytes, got str"),
        ([blob_header(size="big")], "'size' must be float or None, got str"),
        ([blob_header(name="bad")], "blob: name must not be 'bad'"),
        ([blob_header(extra=1)], "unknown fields"),
        ([msgpack.packb({"k": "nope"})], "unknown message type 'nope': k must be one of blob"),
        ([msgpack.packb({"k": ["blob"]})], "unknown message type"),
        ([msgpack.packb([1])], "header must be a map, got list"),
        ([b"\xc1"], "header is not valid msgpack"),
        ([b"\x81\xa1k\xdb\xff\xff\xff\xffabc"], "header is not valid msgpack"),  # 4 GiB str
        ([msgpack.packb({1: 2})], "header is not valid msgpack"),  # keys are strings
    ],
)
def test_malformed_input_is_refused_naming_the_problem(frames, words):
    with pytest.raises(CodecError, match=words):
        BLOBS.decode(frames)


@pytest.mark.parametrize("name", CODECS)
def test_a_header_nested_past_msgpacks_limit_is_refused_saying_so(name):
    with pytest.raises(CodecError, match="nests deeper than msgpack's limit"):
        CODECS[name].decode([b"\x91" * 5000 + b"\x00"])


def test_check_frames_false_decodes_a_header_alone():
    assert BLOBS.decode([blob_header(count=2)], check_frames=False).count == 2


def test_a_schema_without_bytes_refuses_bin_in_the_header():
    with pytest.raises(m.MessageError, match="not valid msgpack"):
        m.decode([msgpack.packb({"t": "abort", "request_id": b"r"}, use_bin_type=True)])


def test_unknown_fields_are_ignored_where_the_schema_says():
    frames = [msgpack.packb({"op": "health", "id": 3, "from_a_newer_client": 1})]
    assert r.REQUESTS.decode(frames) == r.Health(id=3)


def test_an_unsupported_field_type_fails_when_the_schema_is_built():
    class Odd(codec.Message, kind="odd"):
        when: tuple

    with pytest.raises(TypeError, match="unsupported field type"):
        Codec("k", {"odd": Odd}, max_header_bytes=1, max_frame_bytes=1, max_frames=1)
