"""Hypothesis strategies for bad input on the ZeroMQ sockets: random frames, msgpack values of
the wrong types, valid messages with one field broken, truncated headers and headers that
declare huge lengths (a 4 GiB string, a 4-billion-item array) in a few bytes."""

from __future__ import annotations

import msgpack
from hypothesis import strategies as st

# msgpack headers that declare far more than they hold: a decoder must refuse them without
# allocating what they declare.
HUGE = [
    b"\xdd\xff\xff\xff\xff",  # array32 of 4G items
    b"\xdf\xff\xff\xff\xff",  # map32 of 4G pairs
    b"\xc6\xff\xff\xff\xff",  # bin32 of 4 GiB
    b"\xdb\xff\xff\xff\xff",  # str32 of 4 GiB
    b"\xc9\xff\xff\xff\xff\x01",  # ext32 of 4 GiB
    b"\x81\xa1t\xdb\xff\xff\xff\xf0",  # {"t": <str of 4 GiB>}
    b"\x82\xa2op\xa3get\xa4keys\xdd\x7f\xff\xff\xff",  # {"op": "get", "keys": <2G items>}
    b"\x82\xa1t\xa5abort\xaarequest_id\xdd\xff\xff\xff\xff",
    b"\x91" * 100_000 + b"\xc0",  # 100,000 nested arrays
]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=24)
    | st.binary(max_size=40)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)


def pack(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


@st.composite
def broken_header(draw, examples: list[dict], type_key: str) -> bytes:
    """One of ``examples`` (valid header maps) broken in one way."""
    header = dict(draw(st.sampled_from(examples)))
    how = draw(st.sampled_from(["retype", "drop", "extra", "truncate", "type", "whole"]))
    fields = [k for k in header if k != type_key] or [type_key]
    if how == "retype":
        header[draw(st.sampled_from(fields))] = draw(values)
    elif how == "drop":
        header.pop(draw(st.sampled_from(fields)))
    elif how == "extra":
        header[draw(st.text(min_size=1, max_size=10))] = draw(values)
    elif how == "type":
        header[type_key] = draw(st.text(max_size=12) | values)
    elif how == "whole":
        return pack(draw(values))
    raw = pack(header)
    if how == "truncate":
        return raw[: draw(st.integers(min_value=0, max_value=max(0, len(raw) - 1)))]
    return raw


def message_frames(examples: list[dict], type_key: str):
    """Lists of frames: a bad header (or random bytes, or a huge declaration), then 0..3 data
    frames of random bytes."""
    head = (
        broken_header(examples, type_key)
        | st.binary(max_size=300)
        | st.sampled_from(HUGE)
        | st.sampled_from(examples).map(pack)  # valid, with the wrong number of frames
    )
    return st.tuples(head, st.lists(st.binary(max_size=64), max_size=3)).map(
        lambda t: [t[0], *t[1]]
    )
