"""The pool service's wire protocol: typed messages, a msgpack header frame plus raw data frames.

A message is a ZeroMQ multipart message: frame 0 is a msgpack map ``{"op": NAME, "id": INT,
field: value...}``, the frames after it are raw block records (block_record.py: header + payload)
for the messages that carry data (``put``, ``get_ok``). Nothing is ever unpickled. Every field is
checked on decode (type, length, count); anything else raises ``ProtocolError``, which the
service answers with an ``error`` reply, so a malformed frame costs one reply, never the service.

Requests (client -> service) -> their replies:

- ``hello``: the namespace's fields (the service rebuilds the id from them and checks it) and the
  protocol version -> ``hello_ok``: block_bytes, the namespace's arena shm name and size, a nonce
  segment's name and the nonce, the lease length, the frame limit, the service's name.
- ``exists``: keys -> ``exists_ok``: matched, the length of the prefix of keys the pool holds.
- ``get``: keys, shm (may blocks be lent in the arena?) -> ``get_ok``: an offset per found key (a
  prefix of keys): >= 0 a leased arena offset, ``INLINE`` the next data frame holds the record.
- ``release``: keys whose leases the client is done with -> ``ack``.
- ``put``: keys, positions, one record frame per key -> ``put_ok``: stored, per key.
- ``reserve``: keys, positions (a two-phase put through the arena) -> ``reserve_ok``: an offset per
  key, a slot to write, ``PRESENT`` (stored already) or ``NO_ROOM``.
- ``commit``: keys written into their reserved slots -> ``put_ok``; ``abort``: keys -> ``ack``.
- ``remove``: keys -> ``count_ok``: how many were removed.
- ``clear``, ``stats``: a namespace (empty: every namespace) -> ``count_ok``, ``stats_ok``.

Any request may be answered ``error`` (a message naming the field and the limit). Requests other
than ``hello`` carry the namespace id; the service must have seen a ``hello`` for it (it keeps one
store per namespace), else the error says so and the client says hello again.

Same host (the client mapped the arena named in ``hello_ok`` and found the nonce in the nonce
segment): blocks move through shared memory, the socket carries keys and offsets. A ``get``
lease lasts ``lease_ms``; a ``reserve`` lasts as long; the service ends either when its deadline
passes, so a client that dies mid-copy never pins a slot for good.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import msgpack

from engine.kvstore.block_record import MAX_KEY_LEN, NAMESPACE_LEN

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 64 << 20  # a data frame (one block record): far above any block we make
MAX_HEADER_BYTES = 1 << 20  # frame 0
MAX_KEYS = 1024  # keys in one request
INLINE = -1  # get_ok offset: the block is in the next data frame
PRESENT = -1  # reserve_ok offset: the key is stored already (refreshed; nothing to write)
NO_ROOM = -2  # reserve_ok offset: no slot (everything pinned or reserved); the write failed


class ProtocolError(ValueError):
    """A message that does not follow the protocol; the text names the field and the limit."""


def _is_key(v) -> bool:
    return isinstance(v, bytes) and 0 < len(v) <= MAX_KEY_LEN


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# Field checkers by annotation (annotations are strings under ``from __future__``).
_CHECKS = {
    "int": (_is_int, "an integer"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "bool": (lambda v: isinstance(v, bool), "a boolean"),
    "bytes": (lambda v: isinstance(v, bytes), "bytes"),
    "dict": (lambda v: isinstance(v, dict), "a map"),
    "list[bytes]": (lambda v: all(_is_key(k) for k in v), f"keys of 1..{MAX_KEY_LEN} bytes"),
    "list[int]": (lambda v: all(_is_int(k) for k in v), "integers"),
    "list[bool]": (lambda v: all(isinstance(k, bool) for k in v), "booleans"),
}


@dataclass(frozen=True)
class Message:
    OP: ClassVar[str] = ""
    HAS_FRAMES: ClassVar[bool] = False  # data frames follow the header
    id: int = 0


@dataclass(frozen=True)
class Hello(Message):
    OP = "hello"
    model_digest: str = ""
    dtype: str = ""
    block_size: int = 0
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    namespace: bytes = b""  # the id the client computed; the service checks it
    version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class HelloOk(Message):
    OP = "hello_ok"
    block_bytes: int = 0
    shm_name: str = ""  # the namespace's DRAM arena ("" if the service has none)
    arena_bytes: int = 0
    nonce_shm: str = ""  # a small segment holding ``nonce``: mapping it proves the same host
    nonce: bytes = b""
    lease_ms: int = 0
    max_frame_bytes: int = MAX_FRAME_BYTES
    source: str = ""  # "pool@HOST:PORT", as in the events


@dataclass(frozen=True)
class Exists(Message):
    OP = "exists"
    namespace: bytes = b""
    keys: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class ExistsOk(Message):
    OP = "exists_ok"
    matched: int = 0


@dataclass(frozen=True)
class Get(Message):
    OP = "get"
    namespace: bytes = b""
    keys: list[bytes] = field(default_factory=list)
    shm: bool = False


@dataclass(frozen=True)
class GetOk(Message):
    OP = "get_ok"
    HAS_FRAMES = True
    offsets: list[int] = field(default_factory=list)
    frames: tuple = ()  # one record per INLINE offset, in order


@dataclass(frozen=True)
class Release(Message):
    OP = "release"
    namespace: bytes = b""
    keys: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class Put(Message):
    OP = "put"
    HAS_FRAMES = True
    namespace: bytes = b""
    keys: list[bytes] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    frames: tuple = ()  # one record (header + payload) per key


@dataclass(frozen=True)
class PutOk(Message):
    OP = "put_ok"
    stored: list[bool] = field(default_factory=list)


@dataclass(frozen=True)
class Reserve(Message):
    OP = "reserve"
    namespace: bytes = b""
    keys: list[bytes] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class ReserveOk(Message):
    OP = "reserve_ok"
    offsets: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Commit(Message):
    OP = "commit"
    namespace: bytes = b""
    keys: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class Abort(Message):
    OP = "abort"
    namespace: bytes = b""
    keys: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class Remove(Message):
    OP = "remove"
    namespace: bytes = b""
    keys: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class Clear(Message):
    OP = "clear"
    namespace: bytes = b""  # empty: every namespace


@dataclass(frozen=True)
class Stats(Message):
    OP = "stats"
    namespace: bytes = b""  # empty: every namespace


@dataclass(frozen=True)
class CountOk(Message):
    OP = "count_ok"
    count: int = 0


@dataclass(frozen=True)
class StatsOk(Message):
    OP = "stats_ok"
    stats: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Ack(Message):
    OP = "ack"


@dataclass(frozen=True)
class Error(Message):
    OP = "error"
    error: str = ""


REQUESTS = (Hello, Exists, Get, Release, Put, Reserve, Commit, Abort, Remove, Clear, Stats)
REPLIES = (HelloOk, ExistsOk, GetOk, PutOk, ReserveOk, CountOk, StatsOk, Ack, Error)
MESSAGES = {cls.OP: cls for cls in REQUESTS + REPLIES}
_FIELDS = {
    cls: [f for f in dataclasses.fields(cls) if f.name not in ("id", "frames")]
    for cls in MESSAGES.values()
}


def encode(msg: Message) -> list:
    """The frames of ``msg``: its msgpack header, then its data frames (buffers, not copied)."""
    header = {"op": msg.OP, "id": msg.id}
    for f in _FIELDS[type(msg)]:
        header[f.name] = getattr(msg, f.name)
    return [msgpack.packb(header, use_bin_type=True), *getattr(msg, "frames", ())]


def decode(frames: Sequence) -> Message:
    """The message in ``frames`` (bytes or buffers); ProtocolError if it breaks any rule."""
    if not frames:
        raise ProtocolError("a message needs a header frame, got none")
    head = memoryview(frames[0]).cast("B")
    if head.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(f"header frame is {head.nbytes} bytes, the limit is {MAX_HEADER_BYTES}")
    try:
        # The buffer bounds every declared length: a huge declared array fails, allocates nothing.
        header = msgpack.unpackb(head, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several types (ExtraData, FormatError, ValueError)
        raise ProtocolError(f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"header must be a msgpack map, got {type(header).__name__}")
    op = header.get("op")
    cls = MESSAGES.get(op) if isinstance(op, str) else None  # a list is unhashable
    if cls is None:
        raise ProtocolError(f"op must be one of {', '.join(MESSAGES)}, got {_short(op)}")
    msg_id = header.get("id", 0)
    if not _is_int(msg_id) or not 0 <= msg_id < 2**63:
        raise ProtocolError(f"id must be an integer in [0, 2**63), got {msg_id!r}")
    kwargs = {}
    for f in _FIELDS[cls]:
        if f.name not in header:
            raise ProtocolError(f"{cls.OP}: field {f.name} is missing")
        kwargs[f.name] = _check(cls.OP, f, header[f.name])
    data = [memoryview(fr).cast("B") for fr in frames[1:]]
    if data and not cls.HAS_FRAMES:
        raise ProtocolError(f"{cls.OP}: takes no data frames, got {len(data)}")
    for i, fr in enumerate(data):
        if fr.nbytes > MAX_FRAME_BYTES:
            raise ProtocolError(
                f"{cls.OP}: data frame {i} is {fr.nbytes} bytes, the limit is {MAX_FRAME_BYTES}"
            )
    if cls.HAS_FRAMES:
        kwargs["frames"] = tuple(data)
    msg = cls(id=msg_id, **kwargs)
    _check_shape(msg)
    return msg


def _check(op: str, f: dataclasses.Field, value):
    ok, what = _CHECKS[f.type]
    is_list = f.type.startswith("list[")
    if is_list and not isinstance(value, list):
        raise ProtocolError(f"{op}: {f.name} must be a list of {what}, got {type(value).__name__}")
    if is_list and len(value) > MAX_KEYS:
        raise ProtocolError(f"{op}: {f.name} has {len(value)} items, the limit is {MAX_KEYS}")
    if not ok(value):
        raise ProtocolError(f"{op}: {f.name} must be {what}, got {_short(value)}")
    return value


def _check_shape(msg: Message) -> None:
    """Rules between fields."""
    ns = getattr(msg, "namespace", None)
    if ns is not None and ns and len(ns) != NAMESPACE_LEN:
        raise ProtocolError(f"{msg.OP}: namespace must be {NAMESPACE_LEN} bytes, got {len(ns)}")
    if ns == b"" and not isinstance(msg, Clear | Stats):
        raise ProtocolError(f"{msg.OP}: namespace must be {NAMESPACE_LEN} bytes, got 0")
    if isinstance(msg, Put | Reserve) and len(msg.positions) != len(msg.keys):
        raise ProtocolError(
            f"{msg.OP}: positions has {len(msg.positions)} items, keys has {len(msg.keys)}"
        )
    if isinstance(msg, Put) and len(msg.frames) != len(msg.keys):
        raise ProtocolError(f"put: {len(msg.frames)} data frames for {len(msg.keys)} keys")
    if isinstance(msg, GetOk) and len(msg.frames) != msg.offsets.count(INLINE):
        raise ProtocolError(
            f"get_ok: {len(msg.frames)} data frames for {msg.offsets.count(INLINE)} inline blocks"
        )


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
