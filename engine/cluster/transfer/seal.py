"""The seal of a P/D hand-over: what ties the decode side's request to what the prefill side
computed for it.

The per-layer checksums prove each piece of KV arrived as it was sent; they do not say for which
prompt it was computed or which first tokens go with it. A ``KVDone`` therefore carries a seal
over the request's id, its prompt tokens, the checksum of every piece its sender sent, and the
first tokens it hands over. The decode worker computes the same seal from what it holds (the
prompt its ``DecodeRequest`` named, the pieces it verified, the first tokens in the ``KVDone``)
and refuses a transfer whose seal differs: a request assembled from mismatched parts is
recomputed or fails, never decoded. The router closes the chain at the other end: the decode
worker's outputs name the first token each choice continued from, which must be the one the
client was sent (cluster/router/outputs.py).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence

import numpy as np

SEAL_BYTES = 16  # as hex in KVDone.seal


def prompt_digest(token_ids: Sequence[int]) -> bytes:
    """The prompt's tokens, hashed once per request on each side."""
    return hashlib.sha256(np.asarray(token_ids, dtype=np.int64).tobytes()).digest()


def seal(
    request_id: str,
    prompt: bytes,
    pieces: Iterable[tuple[int, int, int, int]],
    firsts: Sequence[dict],
) -> str:
    """``prompt``: prompt_digest's; ``pieces``: (layer, start, end, checksum) of every piece, in
    any order; ``firsts``: the ``KVDone`` first-token entries (their index and token count)."""
    h = hashlib.sha256()
    h.update(request_id.encode())
    h.update(b"\0")
    h.update(prompt)
    for layer, start, end, crc in sorted(pieces):
        h.update(struct.pack("<iiiQ", layer, start, end, crc & (2**64 - 1)))
    entries = sorted(
        (_int64(f.get("index")), _int64(f.get("token"))) for f in firsts if isinstance(f, dict)
    )
    for index, token in entries:
        h.update(struct.pack("<qq", index, token))
    return h.digest()[:SEAL_BYTES].hex()


def _int64(v) -> int:
    """A wire value as a signed 64-bit int; -1 for anything else (it then seals as such)."""
    ok = isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63
    return v if ok else -1
