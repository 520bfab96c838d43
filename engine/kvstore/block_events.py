"""Block events: which KV blocks a holder (a cluster worker's device cache, a pool service) now
holds or dropped, published on a ZeroMQ PUB socket and read by the router and the Conductor.

One event is one msgpack map in a one-frame message (these keys, and no others)::

    {"type": "stored" | "removed", "namespace": "<namespace id hex>",
     "keys": [<block key>, ...], "source": "<holder id>"}

``namespace`` may be absent (a holder that does not know it); ``source`` names the holder (a
worker id, ``pool@HOST:PORT``). On the wire every key is bytes (a 32-byte chained prefix hash);
in one process, the simulator's trace names blocks by integers. Events are hints: subscribers
may miss some (PUB drops for slow or late ones), so an index built from them is confirmed by
whoever loads a block. This module is the only place that builds or parses them.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import msgpack

from engine.kvstore.block_record import MAX_KEY_LEN

EVENT_TYPES = ("stored", "removed")
EVENT_KEYS = 1024  # at most this many keys per published event
MAX_KEY_BYTES = MAX_KEY_LEN  # a chained prefix hash is 32 bytes
_FIELDS = frozenset({"type", "namespace", "keys", "source"})


class BlockEventError(ValueError):
    """A malformed block event; the message names the field."""


@dataclass(frozen=True)
class BlockEvent:
    kind: str  # "stored" | "removed"
    keys: tuple[Hashable, ...]
    source: str = ""
    namespace: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in EVENT_TYPES:
            raise BlockEventError(f"event type must be one of {EVENT_TYPES}, got {self.kind!r}")
        if not isinstance(self.keys, tuple):
            raise BlockEventError(f"event keys must be a tuple, got {type(self.keys).__name__}")
        for key in self.keys:
            _check_key(key)
        if not isinstance(self.source, str):
            raise BlockEventError(f"event source must be a string, got {_kind(self.source)}")
        if self.namespace is not None and not isinstance(self.namespace, str):
            raise BlockEventError(f"event namespace must be a string, got {_kind(self.namespace)}")

    def to_dict(self) -> dict:
        out = {"type": self.kind, "keys": list(self.keys), "source": self.source}
        if self.namespace is not None:
            out["namespace"] = self.namespace
        return out

    def to_wire(self) -> bytes:
        """The event's one frame. Only byte keys travel (an integer key is in-process only)."""
        if not all(isinstance(k, bytes) for k in self.keys):
            raise BlockEventError("event keys on the wire must be bytes")
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def from_dict(cls, event: Mapping) -> BlockEvent:
        """The event a map describes (a decoded frame; the simulator's own events)."""
        if not isinstance(event, Mapping):
            raise BlockEventError(f"an event must be a map, got {_kind(event)}")
        extra = set(event) - _FIELDS
        if extra:
            raise BlockEventError(f"unknown event fields: {sorted(map(repr, extra))}")
        keys = event.get("keys")
        if not isinstance(keys, (list, tuple)):
            raise BlockEventError(f"event keys must be a list, got {_kind(keys)}")
        return cls(event.get("type"), tuple(keys), event.get("source", ""), event.get("namespace"))

    @classmethod
    def from_wire(cls, frame: bytes) -> BlockEvent:
        """The event in one published frame; BlockEventError naming what is wrong otherwise."""
        try:
            event = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True)
        except Exception as exc:  # msgpack raises several types (ExtraData, FormatError, ...)
            raise BlockEventError(f"an event is not valid msgpack: {exc}") from None
        parsed = cls.from_dict(event)
        if not all(isinstance(k, bytes) for k in parsed.keys):
            raise BlockEventError("event keys on the wire must be bytes")
        return parsed

    @classmethod
    def of(cls, event: BlockEvent | Mapping) -> BlockEvent:
        """``event`` itself, or the event a map describes."""
        return event if isinstance(event, BlockEvent) else cls.from_dict(event)


def batches(
    kind: str, keys: Iterable[Hashable], source: str, namespace: str | None = None
) -> Iterator[BlockEvent]:
    """``keys`` as events of at most ``EVENT_KEYS`` keys each (none for no keys)."""
    run: list[Hashable] = []
    for key in keys:
        run.append(key)
        if len(run) == EVENT_KEYS:
            yield BlockEvent(kind, tuple(run), source, namespace)
            run = []
    if run:
        yield BlockEvent(kind, tuple(run), source, namespace)


def _check_key(key: object) -> None:
    if isinstance(key, bytes):
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise BlockEventError(
                f"an event key must be 1 to {MAX_KEY_BYTES} bytes, got {len(key)}"
            )
    elif not isinstance(key, int) or isinstance(key, bool):
        raise BlockEventError(f"an event key must be bytes or an integer, got {_kind(key)}")


def _kind(value: object) -> str:
    return type(value).__name__
