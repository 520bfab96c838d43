"""SIGTERM on real ``engine serve`` / ``engine rpc`` processes: stop admitting (503), let
in-flight requests finish until the drain deadline, abort the rest, exit 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from serverutil import MAX_MODEL_LEN, MODEL

ENGINE_ARGS = [
    "--model",
    MODEL,
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--kv-cache-memory-gb",
    "0.25",
]
START_TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "engine", *args, *ENGINE_ARGS, "--log-level", "warning"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )


def _stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.kill()
    out, _ = proc.communicate(timeout=30)
    return out.decode(errors="replace")


class _Stream(threading.Thread):
    """One streamed completion read to the end in the background."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.first = threading.Event()
        self.finish_reason = None
        self.done = False
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"prompt": "Count:", "max_tokens": self.max_tokens, "ignore_eos": True}
        try:
            with httpx.stream("POST", self.url, json=body | {"stream": True}, timeout=120) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.first.set()
                        chunk = json.loads(line[6:])
                        assert "error" not in chunk, chunk
                        choice = chunk["choices"][0]
                        self.finish_reason = choice["finish_reason"] or self.finish_reason
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.first.set()


def test_sigterm_drains_then_exits_zero():
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _start("serve", "--port", str(port), "--drain-timeout", "4")
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, _stop(proc)
            assert time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        short = _Stream(base + "/v1/completions", 24)  # finishes within the drain
        long = _Stream(base + "/v1/completions", 900)  # outlives it: aborted
        short.start()
        long.start()
        assert short.first.wait(60) and long.first.wait(60)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        status = None
        while time.monotonic() < deadline:
            status = httpx.post(base + "/v1/completions", json={"prompt": "Hi"}).status_code
            if status == 503:
                break
            time.sleep(0.05)
        assert status == 503
        assert httpx.get(base + "/health").status_code == 503
        assert proc.wait(timeout=60) == 0
        short.join(10)
        long.join(10)
        assert short.error is None and short.done and short.finish_reason == "length"
        assert long.error is None and long.done and long.finish_reason == "abort"
    finally:
        _stop(proc)


@pytest.mark.slow
def test_rpc_sigterm_exits_zero():
    from engine.client import RPCClient

    address = f"tcp://127.0.0.1:{_free_port()}"
    proc = _start("rpc", "--address", address, "--drain-timeout", "3")
    try:
        with RPCClient(address, timeout=START_TIMEOUT_S) as client:
            assert client.health()["healthy"]
            stream = client.stream("Count:", max_tokens=900, ignore_eos=True, timeout=60)
            next(stream)
            proc.send_signal(signal.SIGTERM)
            rest = list(stream)
            assert rest[-1].outputs[0].finish_reason == "abort"
        assert proc.wait(timeout=60) == 0
    finally:
        _stop(proc)
