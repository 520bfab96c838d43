"""The cluster's messages: every type round-trips; malformed frames are a MessageError naming
the problem (truncated, wrong types, unknown fields, huge lengths, wrong frame counts)."""

from __future__ import annotations

import msgpack
import pytest

from engine.cluster import messages as m

SAMPLES = [
    m.Register(
        "d0",
        "decode",
        123,
        "default",
        2048,
        "tcp://127.0.0.1:5",
        "/dev/shm/x",
        "shm",
        "h",
        events_address="tcp://127.0.0.1:6",
        shm_digest="ab" * 32,
        pid_ns="4:4026531836",
    ),
    m.Heartbeat("p0", "draining", 1, 2, 0.25, 7, 4096, 1),
    m.Goodbye("p0"),
    m.DecodeReady("r1", 64, 1024),
    m.DecodeReady("r1", 0, 0, error="staging full"),
    m.Outputs(
        "r1",
        "d0",
        [{"index": 0, "offset": 1, "token_ids": [5, 6], "text": "ab", "finish_reason": None}],
        num_cached_tokens=16,
    ),
    m.TransferFailed("r1", "layer 3 checksum mismatch", True),
    m.RequestError("r1", "p0", 400, "max_tokens must be >= 1"),
    m.DecodeRequest("r1", [1, 2, 3], {"max_tokens": 4, "temperature": 0.0}, 30.0),
    m.PrefillRequest("r1", [1, 2, 3], {"n": 2}, "d0", "tcp://h:1", "tcp", "", 0, 96),
    m.Abort("r1"),
    m.FirstTokens(
        "r1", [{"index": 0, "offset": 0, "token_ids": [5], "text": "a", "finish_reason": None}]
    ),
    m.SourceGone("r1", "prefill-0"),
    m.KVLayer("r1", 3, 0, 16, 0xDEADBEEF, True, frames=(b"\x00" * 16, b"\x01" * 16)),
    m.KVLayer("r1", 29, 16, 17, 1, False),
    m.KVDone(
        "r1",
        17,
        30,
        0,
        [{"index": 0, "token": 9, "generator": True}, {"index": 1, "token": 4}],
        frames=(b"state",),
    ),
    m.KVAbort("r1", "aborted by the client"),
    m.Heartbeat(
        "d0", "up", 3, 0, 0.5, 9, 0, 2, steps=12, step_s=0.04, step_batch=2.5, step_tokens=380.0
    ),  # fmt: skip
    m.CopyBlocks("r1", list(range(32)), 1, "tcp://127.0.0.1:7"),
    m.BlockData("r1", "p0", list(range(32)), 1, 1, 123, frames=(b"\x02" * 8,)),
    m.BlockData("r1", "p0", [], 0, 0, 0),
    m.CopyDone("r1", "p1", 1),
    m.ShmProbe("d0", "/dev/shm/engine-kvstage-1-ab"),
    m.ShmReach("p0", "d0", "07" * 16),
    m.ShmReach("p0", "d0"),
    m.DecodeRequest("r1", [1], {}, 30.0, sender_pid=4, sender_local=True),
    m.CopyDone("r1", "p1", 0, error="block data checksum mismatch"),
    m.StageHidden("r1", 16, 32, 0xFEEDFACECAFEBEEF, frames=(b"\x03" * 64,)),
    m.StageAbort("r1", "stage 0 failed: out of memory"),
]


def test_every_type_has_a_sample():
    assert {type(s) for s in SAMPLES} == set(m.MESSAGES.values())


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda s: s.TYPE)
def test_round_trip(msg):
    frames = m.encode(msg)
    back = m.decode([bytes(f) for f in frames])
    assert type(back) is type(msg)
    assert back == msg  # frames compare too (bytes)


def header(**fields) -> bytes:
    return msgpack.packb(fields)


@pytest.mark.parametrize(
    "frames, words",
    [
        ([], "empty"),
        ([b"\x93\x01"], "not valid msgpack"),  # truncated array
        ([m.encode(m.Abort("r"))[0][:-2]], "not valid msgpack"),  # truncated map
        ([msgpack.packb([1, 2])], "must be a map"),
        ([header(t="nope")], "unknown message type"),
        ([header(t="abort")], "'request_id' is missing"),
        ([header(t="abort", request_id=5)], "'request_id' must be str"),
        ([header(t="abort", request_id="r", extra=1)], "unknown fields"),
        (
            [
                header(
                    t="kv_layer",
                    request_id="r",
                    layer="0",
                    start=0,
                    end=1,
                    checksum=0,
                    inline=False,
                )
            ],
            "'layer' must be int",
        ),
        (
            [
                header(
                    t="kv_layer", request_id="r", layer=0, start=0, end=1, checksum=0, inline=True
                )
            ],
            "expected 2 data frame",
        ),
        (
            [header(t="stage_hidden", request_id="r", start=0, end=1, checksum=0)],
            "expected 1 data frame",
        ),
        (
            [
                header(
                    t="decode_request",
                    request_id="r",
                    prompt_token_ids=[1, "x"],
                    params={},
                    deadline_s=1.0,
                )
            ],
            "'prompt_token_ids' item 1 must be int",
        ),
        (
            [
                header(
                    t="heartbeat",
                    worker_id="w",
                    state="up",
                    running=True,
                    waiting=0,
                    kv_usage=0.0,
                    used_blocks=0,
                    staging_used=0,
                    transfers=0,
                )
            ],
            "'running' must be int",
        ),
        ([b"\x00" * (m.MAX_HEADER_BYTES + 1)], "over the limit"),
        ([m.encode(m.Abort("r"))[0]] + [b""] * m.MAX_FRAMES, "too many frames"),
        ([msgpack.packb({"t": "abort", "request_id": b"\x00" * 10})], "not valid msgpack"),
    ],
)
def test_malformed_frames_are_errors(frames, words):
    with pytest.raises(m.MessageError, match=words):
        m.decode(frames)


def test_huge_declared_length_is_an_error_not_an_allocation():
    # A str32 header claiming 4 GiB with 3 bytes behind it: msgpack must refuse, not allocate.
    frame = b"\x81\xa1t\xdb\xff\xff\xff\xffabc"
    with pytest.raises(m.MessageError):
        m.decode([frame])


def test_random_garbage_never_raises_anything_else():
    import random

    rng = random.Random(0)
    good = m.encode(SAMPLES[8])[0]
    for _ in range(500):
        b = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        try:
            m.decode([bytes(b[: rng.randint(0, len(b))])])
        except m.MessageError:
            pass
