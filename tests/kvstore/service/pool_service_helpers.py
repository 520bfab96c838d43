"""Shared by the pool service tests: free ports, a small namespace, and `engine pool serve`
started as a real subprocess (killed by the caller in `finally`)."""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import time
from pathlib import Path

from engine.ipc.ports import free_port  # noqa: F401  (the tests import it from here)
from engine.kvstore.namespace import KVNamespace

REPO = Path(__file__).resolve().parents[3]


def small_namespace(digest: str = "test-model", layers: int = 2) -> KVNamespace:
    """block_bytes = layers * 2 * 16 * 2 * 8 * 4 = 4 KiB for 2 layers."""
    return KVNamespace(
        model_digest=digest,
        dtype="float32",
        block_size=16,
        num_layers=layers,
        num_kv_heads=2,
        head_dim=8,
    )


def block(i: int, nbytes: int) -> bytes:
    """A block whose bytes depend on i everywhere (a wrong block never compares equal)."""
    return (i.to_bytes(4, "little") * (nbytes // 4 + 1))[:nbytes]


def key(i: int, salt: int = 0) -> bytes:
    return (i + 1000 * salt).to_bytes(4, "little") * 8


def start_service(
    *args: str, timeout: float = 60.0, ready: bytes = b"pool service ready"
) -> subprocess.Popen:
    """`engine pool serve ARGS`, once it printed its ready line (ports bound)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.cli.main", "pool", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=REPO,
    )
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    line = b""
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if sel.select(timeout=0.2):
                line = proc.stdout.readline()
                if line.startswith(ready):
                    return proc
        raise RuntimeError(f"pool service did not start (rc={proc.poll()}, last line {line!r})")
    except BaseException:
        stop(proc)
        raise
    finally:
        sel.close()


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.kill()
    proc.wait(timeout=10)
