"""The record format of one KV block outside the paged cache: a fixed header, then the payload.

The same bytes are an SSD record file, a block on the pool service's wire and an object in the
Mooncake Store, so a block is verified the same way wherever it comes from.

Header (little endian, ``HEADER_SIZE`` = 72 bytes, a multiple of 8 so the payload stays aligned):

    magic      4s   b"EKVB"
    version    u16  FORMAT_VERSION (a reader refuses any other)
    key_len    u16  length of the key (<= MAX_KEY_LEN); the key field is zero-padded
    namespace  16s  the KVNamespace id (model fingerprint + KV layout)
    key        32s  the block's chained prefix hash
    length     u64  payload length in bytes
    checksum   u64  xxh3_64 of the payload

xxh3_64 runs at memory speed (tens of GB/s, ~10x zlib.crc32), so verifying every block read is
cheap next to moving it. It detects corruption, not tampering: the pool trusts its own hosts.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import xxhash

MAGIC = b"EKVB"
FORMAT_VERSION = 1
NAMESPACE_LEN = 16
MAX_KEY_LEN = 32
_HEADER = struct.Struct("<4sHH16s32sQQ")
HEADER_SIZE = _HEADER.size  # 72


class RecordHeader(NamedTuple):
    namespace: bytes
    key: bytes
    length: int
    checksum: int


def checksum(payload) -> int:
    """xxh3_64 of any buffer (bytes, memoryview, contiguous numpy array)."""
    return xxhash.xxh3_64_intdigest(payload)


def encode_header(namespace: bytes, key: bytes, payload) -> bytes:
    """The header for ``payload`` (any contiguous buffer); write it, then the payload."""
    if len(namespace) != NAMESPACE_LEN:
        raise ValueError(f"namespace must be {NAMESPACE_LEN} bytes, got {len(namespace)}")
    if not 0 < len(key) <= MAX_KEY_LEN:
        raise ValueError(f"key must be 1..{MAX_KEY_LEN} bytes, got {len(key)}")
    view = memoryview(payload).cast("B")
    return _HEADER.pack(
        MAGIC, FORMAT_VERSION, len(key), namespace, key, view.nbytes, checksum(view)
    )


def parse_header(buf) -> RecordHeader | None:
    """The header at the start of ``buf`` without checking the payload; None if ``buf`` is too
    short or the magic, version or key length are wrong (used to rebuild an index cheaply)."""
    view = memoryview(buf).cast("B")
    if view.nbytes < HEADER_SIZE:
        return None
    magic, version, key_len, namespace, key, length, csum = _HEADER.unpack_from(view, 0)
    if magic != MAGIC or version != FORMAT_VERSION or not 0 < key_len <= MAX_KEY_LEN:
        return None
    return RecordHeader(namespace, key[:key_len], length, csum)


def decode_and_verify(namespace: bytes, key: bytes, buf) -> memoryview | None:
    """The payload of the record in ``buf`` (header + payload, nothing after), as a view into
    ``buf``; None if the magic, version, namespace, key, length or checksum is wrong."""
    view = memoryview(buf).cast("B")
    header = parse_header(view)
    if (
        header is None
        or header.namespace != namespace
        or header.key != key
        or header.length != view.nbytes - HEADER_SIZE
    ):
        return None
    payload = view[HEADER_SIZE:]
    if checksum(payload) != header.checksum:
        return None
    return payload
