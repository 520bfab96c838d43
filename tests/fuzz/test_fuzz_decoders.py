"""Every decoder of bytes from a socket or a disk, fed garbage: the cluster's messages, the pool
service's protocol and KV block records. Each returns a valid value or raises its own error type
(which the sockets answer or log); nothing else escapes, and huge declared lengths allocate
nothing. The default suite runs a bounded number of examples; the slow test runs many more."""

from __future__ import annotations

import time
import tracemalloc

import msgpack
import pytest
from fuzz_frames import HUGE, message_frames
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.cluster import messages as m
from engine.kvstore import block_record
from engine.kvstore.service import protocol as P

START = 0.0  # when the module started (tests/fuzz/conftest.py sets it)

NS = b"n" * 16
KEY = b"k" * 32

CLUSTER_EXAMPLES = [
    m.encode(msg)
    for msg in (
        m.Register("w", "decode", 1, "default", 1024, "tcp://127.0.0.1:1", "", "tcp", "h"),
        m.Heartbeat("w", "up", 1, 2, 0.5, 3, 4, 5),
        m.Goodbye("w"),
        m.DecodeReady("r", 0, 64),
        m.Outputs(
            "r",
            "w",
            [
                {
                    "index": 0,
                    "offset": 0,
                    "token_ids": [1],
                    "text_offset": 0,
                    "text": "a",
                    "logprobs": None,
                    "finish_reason": None,
                    "stop_reason": None,
                }
            ],
        ),  # fmt: skip
        m.TransferFailed("r", "x", True),
        m.RequestError("r", "w", 400, "bad"),
        m.DecodeRequest("r", [1, 2, 3], {"max_tokens": 4}, 10.0),
        m.PrefillRequest("r", [1, 2], {}, "d", "tcp://127.0.0.1:1", "tcp", "", 0, 64),
        m.Abort("r"),
        m.KVLayer("r", 0, 0, 4, 123, True, frames=(b"k" * 8, b"v" * 8)),
        m.KVDone("r", 4, 2, 0, [{"index": 0, "token": 1}]),
        m.KVAbort("r", "x"),
    )
]
CLUSTER_HEADERS = [msgpack.unpackb(f[0]) for f in CLUSTER_EXAMPLES]

POOL_EXAMPLES = [
    P.encode(msg)
    for msg in (
        P.Hello(
            id=1,
            model_digest="d",
            dtype="float32",
            block_size=16,
            num_layers=2,
            num_kv_heads=2,
            head_dim=8,
            namespace=NS,
        ),  # fmt: skip
        P.Exists(id=2, namespace=NS, keys=[KEY]),
        P.Get(id=3, namespace=NS, keys=[KEY], shm=True),
        P.Release(id=4, namespace=NS, keys=[KEY]),
        P.Put(id=5, namespace=NS, keys=[KEY], positions=[0], frames=(b"x" * 80,)),
        P.Reserve(id=6, namespace=NS, keys=[KEY], positions=[0]),
        P.Commit(id=7, namespace=NS, keys=[KEY]),
        P.Abort(id=8, namespace=NS, keys=[KEY]),
        P.Remove(id=9, namespace=NS, keys=[KEY]),
        P.Clear(id=10),
        P.Stats(id=11),
    )
]
POOL_HEADERS = [msgpack.unpackb(f[0]) for f in POOL_EXAMPLES]

FAST = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
LONG = settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck))


COUNTS = {"cluster_frames": 0, "pool_frames": 0, "records": 0, "refused": 0}


def _cluster(frames: list) -> None:
    COUNTS["cluster_frames"] += 1
    try:
        msg = m.decode(frames)
    except m.MessageError as exc:
        COUNTS["refused"] += 1
        assert str(exc)  # a message that names the problem
        return
    assert isinstance(msg, m.Message) and len(msg.frames) == msg.expected_frames()


def _pool(frames: list) -> None:
    COUNTS["pool_frames"] += 1
    try:
        msg = P.decode(frames)
    except P.ProtocolError as exc:
        COUNTS["refused"] += 1
        assert str(exc)
        return
    assert isinstance(msg, P.Message)


def test_valid_examples_decode():
    for frames in CLUSTER_EXAMPLES:
        assert m.decode(frames).TYPE == msgpack.unpackb(frames[0])["t"]
    for frames in POOL_EXAMPLES:
        assert P.decode(frames).OP == msgpack.unpackb(frames[0])["op"]


@pytest.mark.parametrize("head", HUGE)
def test_huge_declared_lengths_allocate_nothing(head):
    tracemalloc.start()
    try:
        for decode, err in ((m.decode, m.MessageError), (P.decode, P.ProtocolError)):
            with pytest.raises(err):
                decode([head])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak  # the declarations claim GiBs


@FAST
@given(message_frames(CLUSTER_HEADERS, "t"))
def test_cluster_messages_refuse_garbage(frames):
    _cluster(frames)


@FAST
@given(message_frames(POOL_HEADERS, "op"))
def test_pool_protocol_refuses_garbage(frames):
    _pool(frames)


@FAST
@given(st.binary(max_size=200), st.integers(0, 300), st.binary(max_size=8))
def test_block_records_refuse_garbage(payload, cut, flip):
    COUNTS["records"] += 1
    good = block_record.encode_header(NS, KEY, payload) + payload
    assert bytes(block_record.decode_and_verify(NS, KEY, good)) == payload
    bad = bytearray(good[: min(cut, len(good))] if cut < len(good) else good)
    if flip and bad:
        i = flip[0] % len(bad)
        bad[i] ^= flip[-1] or 1
    out = block_record.decode_and_verify(NS, KEY, bytes(bad))
    assert out is None or bytes(out) == payload  # never a wrong payload
    assert block_record.decode_and_verify(NS, b"other", good) is None
    assert block_record.decode_and_verify(b"m" * 16, KEY, good) is None


@pytest.mark.slow
@LONG
@given(
    st.one_of(message_frames(CLUSTER_HEADERS, "t"), message_frames(POOL_HEADERS, "op")),
)
def test_decoders_refuse_garbage_long(frames):
    _cluster(frames)
    _pool(frames)


def test_write_decoder_record():
    from reliab_record import record_if_the_run_passes

    assert COUNTS["cluster_frames"] and COUNTS["pool_frames"]
    record_if_the_run_passes(
        "fuzz",
        "decoders",
        "cluster messages and pool protocol decoders: random bytes, broken/truncated msgpack "
        "headers, wrong field types, extra/missing fields, 9 huge-length declarations (4 GiB "
        "strings/bins, 4G-item arrays/maps, 100,000 nested arrays); KV block records cut/flipped",
        dict(COUNTS),
        "each input decoded to a valid message or raised the decoder's own error naming the "
        "problem; huge declarations allocated < 16 MiB; a damaged record never verified",
        duration_s=time.monotonic() - START,
    )
