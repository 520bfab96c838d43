"""Checks of the shared-memory names that travel between processes.

A prefill worker maps the staging arena a router message names; a pool client maps the arenas a
pool service names in ``hello_ok``. A peer that could name any file would make us map (and write
to) ``/dev/shm/../../home/...``; so a name must carry one of our own prefixes and consist of
letters, digits, ``.``, ``_`` and ``-`` only (no path separator, no ``..``), and a path must be
exactly ``/dev/shm/<such a name>``.
"""

from __future__ import annotations

import re

SHM_DIR = "/dev/shm"
STAGING_PREFIX = "engine-kvstage-"  # a decode worker's staging arena (cluster/transfer/staging.py)
POOL_PREFIX = "engine-kv-"  # the pool's DRAM arenas and its host nonce (kvcache/)
MAX_NAME = 200
_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def check_shm_name(name: object, prefix: str) -> str:
    """``name`` if it is one of ours; ValueError naming the rule it breaks."""
    if not isinstance(name, str):
        raise ValueError(f"shared-memory name must be a string, got {type(name).__name__}")
    if not name.startswith(prefix):
        raise ValueError(f"shared-memory name {name[:80]!r} must start with {prefix!r}")
    if len(name) > MAX_NAME:
        raise ValueError(f"shared-memory name of {len(name)} characters is over {MAX_NAME}")
    if not _NAME.fullmatch(name) or ".." in name:
        raise ValueError(
            f"shared-memory name {name[:80]!r} may hold only letters, digits, '.', '_' and '-' "
            "(no path separators, no '..')"
        )
    return name


def check_shm_path(path: object, prefix: str) -> str:
    """``path`` if it is ``/dev/shm/<one of our names>``; ValueError otherwise."""
    if not isinstance(path, str) or not path.startswith(SHM_DIR + "/"):
        raise ValueError(f"shared-memory path {str(path)[:80]!r} must be in {SHM_DIR}/")
    check_shm_name(path[len(SHM_DIR) + 1 :], prefix)
    return path
