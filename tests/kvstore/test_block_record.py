from __future__ import annotations

import numpy as np
import pytest

from engine.kvstore import block_record as br

NS = bytes(range(16))
KEY = bytes(range(100, 132))


def _record(payload: bytes, ns: bytes = NS, key: bytes = KEY) -> bytearray:
    return bytearray(br.encode_header(ns, key, payload) + payload)


def test_round_trip_returns_payload_view():
    payload = np.arange(1000, dtype=np.float32).tobytes()
    rec = _record(payload)
    assert br.HEADER_SIZE == 72 and br.HEADER_SIZE % 8 == 0
    out = br.decode_and_verify(NS, KEY, rec)
    assert out is not None and bytes(out) == payload
    header = br.parse_header(rec)
    assert header == (NS, KEY, len(payload), br.checksum(payload))


def test_accepts_numpy_and_memoryview_payloads():
    arr = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float16)
    rec = bytearray(br.encode_header(NS, KEY, arr)) + arr.tobytes()
    assert bytes(br.decode_and_verify(NS, KEY, memoryview(rec))) == arr.tobytes()


@pytest.mark.parametrize("where", [0, 4, 6, 10, 30, 60, 64, 72, 500, -1])
def test_any_flipped_byte_is_rejected(where):
    rec = _record(b"x" * 1000)
    rec[where] ^= 0x40
    assert br.decode_and_verify(NS, KEY, rec) is None


def test_wrong_namespace_key_or_length_is_rejected():
    rec = _record(b"abc" * 100)
    assert br.decode_and_verify(bytes(16), KEY, rec) is None
    assert br.decode_and_verify(NS, bytes(32), rec) is None
    assert br.decode_and_verify(NS, KEY, rec[:-1]) is None  # truncated
    assert br.decode_and_verify(NS, KEY, rec + b"\0") is None  # trailing bytes
    assert br.decode_and_verify(NS, KEY, rec[: br.HEADER_SIZE - 1]) is None
    assert br.parse_header(b"short") is None


def test_short_keys_and_bad_arguments():
    rec = _record(b"p", key=b"k1")
    assert bytes(br.decode_and_verify(NS, b"k1", rec)) == b"p"
    assert br.decode_and_verify(NS, b"k1\0", rec) is None
    with pytest.raises(ValueError, match="namespace"):
        br.encode_header(b"short", KEY, b"p")
    with pytest.raises(ValueError, match="key"):
        br.encode_header(NS, bytes(33), b"p")
