"""Block events: one typed event, built and parsed only through engine/kvstore/block_events.py,
whose wire form is the msgpack map the publishers always sent; anything else is refused with an
error naming what is wrong."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cluster.conductor.prefix_index import PrefixIndex
from engine.kvstore.block_events import (
    EVENT_KEYS,
    BlockEvent,
    BlockEventError,
    batches,
)

KEYS = (b"a" * 32, b"b" * 32)


def test_the_wire_form_round_trips_and_is_the_map_subscribers_always_read():
    ev = BlockEvent("stored", KEYS, "prefill-0", "ab12")
    raw = ev.to_wire()
    assert msgpack.unpackb(raw, raw=False) == {
        "type": "stored",
        "namespace": "ab12",
        "keys": list(KEYS),
        "source": "prefill-0",
    }
    assert BlockEvent.from_wire(raw) == ev
    # A publisher that knows no namespace leaves the field out.
    anon = BlockEvent("removed", KEYS[:1], "pool@h:1")
    assert "namespace" not in msgpack.unpackb(anon.to_wire(), raw=False)
    assert BlockEvent.from_wire(anon.to_wire()) == anon


def test_a_map_packed_as_the_old_publishers_did_is_read():
    old = msgpack.packb({"type": "removed", "namespace": "", "keys": list(KEYS), "source": "w"})
    assert BlockEvent.from_wire(old) == BlockEvent("removed", KEYS, "w", "")


@pytest.mark.parametrize(
    "event, field",
    [
        ({"type": "bogus", "keys": [], "source": "w"}, "type"),
        ({"keys": [], "source": "w"}, "type"),
        ({"type": "stored", "source": "w"}, "keys"),
        ({"type": "stored", "keys": b"x" * 32, "source": "w"}, "keys"),
        ({"type": "stored", "keys": [b""], "source": "w"}, "key"),
        ({"type": "stored", "keys": [b"x" * 33], "source": "w"}, "key"),
        ({"type": "stored", "keys": [1.5], "source": "w"}, "key"),
        ({"type": "stored", "keys": [True], "source": "w"}, "key"),
        ({"type": "stored", "keys": [], "source": 7}, "source"),
        ({"type": "stored", "keys": [], "source": "w", "namespace": 3}, "namespace"),
        ({"type": "stored", "keys": [], "source": "w", "extra": 1}, "unknown event fields"),
        ([1, 2], "map"),
    ],
)
def test_a_malformed_event_is_refused_naming_the_field(event, field):
    with pytest.raises(BlockEventError, match=field):
        BlockEvent.from_wire(msgpack.packb(event))


def test_integer_keys_stay_in_process():
    """The simulator names blocks by integers: fine in a map handed over in one process, refused
    on the wire in both directions."""
    ev = BlockEvent.from_dict({"type": "stored", "keys": [1, 2, 3]})
    assert ev == BlockEvent("stored", (1, 2, 3))
    with pytest.raises(BlockEventError, match="bytes"):
        ev.to_wire()
    with pytest.raises(BlockEventError, match="bytes"):
        BlockEvent.from_wire(msgpack.packb({"type": "stored", "keys": [1], "source": "w"}))


def test_not_msgpack_is_refused():
    with pytest.raises(BlockEventError, match="msgpack"):
        BlockEvent.from_wire(b"\xc1")
    with pytest.raises(BlockEventError, match="msgpack"):
        BlockEvent.from_wire(msgpack.packb({"type": "stored"}) + b"x")


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_is_an_event_or_the_events_own_error(raw):
    try:
        ev = BlockEvent.from_wire(raw)
    except BlockEventError as exc:
        assert str(exc)
        return
    assert BlockEvent.from_wire(ev.to_wire()) == ev


def test_batches_split_at_the_limit_and_send_nothing_for_no_keys():
    keys = [i.to_bytes(32, "big") for i in range(EVENT_KEYS + 3)]
    got = list(batches("stored", keys, "pool@h:1", "ns"))
    assert [len(e.keys) for e in got] == [EVENT_KEYS, 3]
    assert [k for e in got for k in e.keys] == keys
    assert {(e.kind, e.source, e.namespace) for e in got} == {("stored", "pool@h:1", "ns")}
    assert list(batches("removed", [], "w")) == []


def test_the_prefix_index_takes_events_and_their_maps_alike():
    index = PrefixIndex(namespace="ns")
    index.add_holder("w")
    assert index.apply("w", BlockEvent("stored", KEYS, "w", "ns"))
    assert index.match("w", list(KEYS)) == 2
    assert index.apply("w", {"type": "removed", "keys": [KEYS[1]], "source": "w"})
    assert index.match("w", list(KEYS)) == 1
    assert not index.apply("w", BlockEvent("stored", KEYS, "w", "other"))  # another model's
    assert not index.apply("nobody", BlockEvent("stored", KEYS, "nobody"))
    with pytest.raises(BlockEventError):
        index.apply("w", {"type": "stored", "keys": "not a list"})
