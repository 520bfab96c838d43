"""Helpers for the tests that start ``engine cluster`` (and its roles) as processes."""

from __future__ import annotations

import subprocess
import time

import httpx


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    """Until ``url``/health answers 200; AssertionError if ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("the cluster did not become healthy")
