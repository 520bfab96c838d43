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
  prefix of keys): >= 0 a leased arena offset, ``INLINE`` the next data frame holds the record;
  and per offset the block's checksum, which the reader checks its copy from the arena against.
- ``release``: keys whose leases the client is done with -> ``ack``.
- ``put``: keys, positions, one record frame per key -> ``put_ok``: stored, per key.
- ``reserve``: keys, positions (a two-phase put through the arena) -> ``reserve_ok``: an offset per
  key, a slot to write, ``PRESENT`` (stored already) or ``NO_ROOM``.
- ``commit``: keys written into their reserved slots, with the checksum of what was written into
  each (a slot that does not hold it is not stored) -> ``put_ok``; ``abort``: keys -> ``ack``.
- ``remove``: keys -> ``count_ok``: how many were removed.
- ``clear``, ``stats``: a namespace (empty: every namespace) -> ``count_ok``, ``stats_ok``.

Any request may be answered ``error`` (a message naming the field and the limit). Requests other
than ``hello`` carry the namespace id; the service must have seen a ``hello`` for it (it keeps one
store per namespace), else the error says so and the client says hello again.

Requests whose offsets are arena offsets (``get`` with shm, ``reserve``, ``commit``) also name the
arena the client mapped at its hello (``arena``): a service that holds another one (it restarted,
and another client's hello opened the namespace again) refuses them, the error ending in ``send
hello first`` as for an unknown namespace. Offsets of one arena read or written through the
mapping of another are other blocks' bytes: a restarted pool served them as hits before this check.

Same host (the client mapped the arena named in ``hello_ok`` and found the nonce in the nonce
segment): blocks move through shared memory, the socket carries keys and offsets. A ``get``
lease lasts ``lease_ms``; a ``reserve`` lasts as long; the service ends either when its deadline
passes, so a client that dies mid-copy never pins a slot for good.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import field
from typing import Annotated

from engine.ipc import codec
from engine.ipc.codec import Len, Range
from engine.kvstore.block_record import MAX_KEY_LEN, NAMESPACE_LEN

PROTOCOL_VERSION = 2  # 2: shm requests name their arena; blocks through it carry checksums
MAX_FRAME_BYTES = 64 << 20  # a data frame (one block record): far above any block we make
MAX_HEADER_BYTES = 1 << 20  # frame 0
MAX_KEYS = 1024  # keys in one request
INLINE = -1  # get_ok offset: the block is in the next data frame
PRESENT = -1  # reserve_ok offset: the key is stored already (refreshed; nothing to write)
NO_ROOM = -2  # reserve_ok offset: no slot (everything pinned or reserved); the write failed

# Field types with their limits (engine/ipc/codec.py checks them on decode).
MsgId = Annotated[int, Range(0, 2**63 - 1)]
Keys = Annotated[list[Annotated[bytes, Len(1, MAX_KEY_LEN)]], Len(0, MAX_KEYS)]
Ints = Annotated[list[int], Len(0, MAX_KEYS)]
Bools = Annotated[list[bool], Len(0, MAX_KEYS)]
Namespace = Annotated[bytes, Len(NAMESPACE_LEN, NAMESPACE_LEN)]
AnyNamespace = Annotated[bytes, Len(0, 0)] | Namespace  # empty: every namespace


class ProtocolError(codec.CodecError):
    """A message that does not follow the protocol; the text names the field and the limit."""


class Message(codec.Message):
    @property
    def OP(self) -> str:  # noqa: N802 (the kind, by the name the service's code reads)
        return self.KIND

    id: MsgId = 0


class _KeysRequest(Message):
    """A request about some keys of one namespace."""

    namespace: Namespace = b""
    keys: Keys = field(default_factory=list)


class Hello(Message, kind="hello"):
    model_digest: str = ""
    dtype: str = ""
    block_size: int = 0
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    namespace: Namespace = b""  # the id the client computed; the service checks it
    version: int = PROTOCOL_VERSION


class HelloOk(Message, kind="hello_ok"):
    block_bytes: int = 0
    shm_name: str = ""  # the namespace's DRAM arena ("" if the service has none)
    arena_bytes: int = 0
    nonce_shm: str = ""  # a small segment holding ``nonce``: mapping it proves the same host
    nonce: bytes = b""
    lease_ms: int = 0
    max_frame_bytes: int = MAX_FRAME_BYTES
    source: str = ""  # "pool@HOST:PORT", as in the events


class Exists(_KeysRequest, kind="exists"):
    """-> ``exists_ok``: how many of the keys, from the first, the pool holds."""


class ExistsOk(Message, kind="exists_ok"):
    """The length of the prefix of the keys that the pool holds."""

    matched: int = 0


class Get(_KeysRequest, kind="get"):
    shm: bool = False
    arena: str = ""  # with shm: the arena the client mapped (hello_ok's shm_name)


class GetOk(Message, kind="get_ok"):
    """``frames``: one record per INLINE offset, in order. ``checksums``: per offset, the
    leased block's checksum (block_record.checksum; 0 for INLINE), which the reader checks its
    copy against."""

    offsets: Ints = field(default_factory=list)
    checksums: Ints = field(default_factory=list)

    def expected_frames(self) -> int:
        return self.offsets.count(INLINE)


class Release(_KeysRequest, kind="release"):
    """The client is done with the leases ``get`` gave it -> ``ack``."""


class Put(_KeysRequest, kind="put"):
    """``frames``: one record (header + payload) per key."""

    positions: Ints = field(default_factory=list)

    def expected_frames(self) -> int:
        return len(self.keys)

    def problem(self) -> str | None:
        return _positions_problem(self)


class PutOk(Message, kind="put_ok"):
    stored: Bools = field(default_factory=list)


class Reserve(_KeysRequest, kind="reserve"):
    positions: Ints = field(default_factory=list)
    arena: str = ""  # the arena the client will write the slots through

    def problem(self) -> str | None:
        return _positions_problem(self)


class ReserveOk(Message, kind="reserve_ok"):
    offsets: Ints = field(default_factory=list)


class Commit(_KeysRequest, kind="commit"):
    """The reserved slots of these keys are written: store them -> ``put_ok``."""

    arena: str = ""  # the arena the client wrote the slots through
    # per key, the checksum of what the client wrote: a slot that does not hold it is refused
    checksums: Ints = field(default_factory=list)


class Abort(_KeysRequest, kind="abort"):
    """Give the reserved slots of these keys back, unwritten -> ``ack``."""


class Remove(_KeysRequest, kind="remove"):
    """-> ``count_ok``: how many of the keys were removed."""


class Clear(Message, kind="clear"):
    """Drop every block of a namespace (empty: of every namespace) -> ``count_ok``."""

    namespace: AnyNamespace = b""


class Stats(Message, kind="stats"):
    """-> ``stats_ok``: the service's counters and each namespace's (or one namespace's)."""

    namespace: AnyNamespace = b""


class CountOk(Message, kind="count_ok"):
    """How many blocks a ``remove`` or ``clear`` dropped."""

    count: int = 0


class StatsOk(Message, kind="stats_ok"):
    stats: dict = field(default_factory=dict)


class Ack(Message, kind="ack"):
    """The request was done; nothing to say."""


class Error(Message, kind="error"):
    """The request was refused: ``error`` names the field and the limit, or the cause."""

    error: str = ""


REQUESTS = (Hello, Exists, Get, Release, Put, Reserve, Commit, Abort, Remove, Clear, Stats)
REPLIES = (HelloOk, ExistsOk, GetOk, PutOk, ReserveOk, CountOk, StatsOk, Ack, Error)
MESSAGES = {cls.KIND: cls for cls in REQUESTS + REPLIES}
CODEC = codec.Codec(
    "op",
    MESSAGES,
    error=ProtocolError,
    max_header_bytes=MAX_HEADER_BYTES,
    max_frame_bytes=MAX_FRAME_BYTES,
    max_frames=1 + MAX_KEYS,  # a put: a record per key
    defaults_optional=False,
    ignore_unknown=True,
)


def encode(msg: Message) -> list:
    """The frames of ``msg``: its msgpack header, then its data frames (buffers, not copied)."""
    return CODEC.encode(msg)


def decode(frames: Sequence) -> Message:
    """The message in ``frames`` (bytes or buffers); ProtocolError if it breaks any rule."""
    return CODEC.decode(frames)  # type: ignore[return-value]


def _positions_problem(msg: Put | Reserve) -> str | None:
    if len(msg.positions) != len(msg.keys):
        return f"positions has {len(msg.positions)} items, keys has {len(msg.keys)}"
    return None
