"""Proof that a prefill worker shares a decode worker's /dev/shm, never a comparison of hostnames:
two containers or network namespaces may carry one hostname and still have /dev/shm apart.

The decode worker writes a random nonce into a small file beside its staging arena
(``<arena>.nonce``, swept with the arena: same prefix, same pid) and registers a digest of it.
The router asks each prefill worker to read the nonce at that path (``ShmProbe``); the worker
answers with what it found (``ShmReach``), and the router uses shared memory only for pairs whose
answer matches the registered digest (``proves``), TCP otherwise. The nonce itself never leaves
the host except in that answer, so a worker elsewhere cannot learn it from a registration.

Shared memory proves one kernel, not one pid namespace (containers may share /dev/shm and still
number processes apart): ``pid_namespace`` names this process's, so the router can also tell
whether a decode worker may watch the prefill worker's pid.
"""

from __future__ import annotations

import hashlib
import hmac
import os

from engine.ipc.shm_names import STAGING_PREFIX, check_shm_path

NONCE_BYTES = 16
SUFFIX = ".nonce"
_DOMAIN = b"engine-kvstage-nonce/1"


def nonce_path(arena_path: str) -> str:
    return arena_path + SUFFIX


def digest(nonce: bytes) -> str:
    """What a decode worker registers: the nonce's SHA-256 (hex), under a domain tag."""
    return hashlib.sha256(_DOMAIN + nonce).hexdigest()


def proves(nonce: bytes, expected: str) -> bool:
    """Whether ``nonce`` (a prefill worker's answer) is the one behind ``expected``."""
    if len(nonce) != NONCE_BYTES or not expected:
        return False
    return hmac.compare_digest(digest(nonce), expected)


class ArenaNonce:
    """The decode worker's nonce file beside its staging arena; ``close`` removes it."""

    def __init__(self, arena_path: str) -> None:
        check_shm_path(arena_path, STAGING_PREFIX)
        self.path = nonce_path(arena_path)
        nonce = os.urandom(NONCE_BYTES)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            os.write(fd, nonce)
        finally:
            os.close(fd)
        self.digest = digest(nonce)

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def read_nonce(arena_path: str) -> bytes:
    """The nonce beside the arena a router message names, if this process can read it (the same
    /dev/shm); b"" otherwise. The path is checked to be one of ours before anything is opened."""
    try:
        check_shm_path(arena_path, STAGING_PREFIX)
        with open(nonce_path(arena_path), "rb") as f:
            nonce = f.read(NONCE_BYTES + 1)
    except (OSError, ValueError):
        return b""
    return nonce if len(nonce) == NONCE_BYTES else b""


def pid_namespace() -> str:
    """This process's pid namespace as "dev:inode" ("" if unknown). Comparable between two
    processes only when they share a kernel, which a shared /dev/shm proves."""
    try:
        st = os.stat("/proc/self/ns/pid")
    except OSError:
        return ""
    return f"{st.st_dev}:{st.st_ino}"
