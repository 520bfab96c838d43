"""Helpers for the server tests: servers on free ports of 127.0.0.1, and waiting for idle."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import threading
import time

import httpx
import uvicorn

MODEL = "default"
MAX_MODEL_LEN = 1024


class HTTPServer:
    """uvicorn on a free port in a background thread."""

    def __init__(self, app, limits=None) -> None:
        from engine.server.uvicorn_server import uvicorn_config

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn_config(app, limits, log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> HTTPServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def http_server(llm, api_key: str | None = None, limits=None, **app_kwargs) -> HTTPServer:
    from engine.server.http_server import build_app

    app = build_app(llm, [MODEL], api_key=api_key, shutdown_engine=False, **app_kwargs)
    return HTTPServer(app, limits)


class RPCThread:
    """The RPC server on tcp://127.0.0.1:<free port>, its loop on a background thread."""

    def __init__(self, llm, **kwargs) -> None:
        from engine.server.rpc_server import RPCServer

        self.rpc = RPCServer(
            llm, "tcp://127.0.0.1:0", model_name=MODEL, shutdown_engine=False, **kwargs
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self._ready = threading.Event()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        ready = asyncio.Event()

        async def main() -> None:
            task = asyncio.ensure_future(self.rpc.serve(ready))
            await ready.wait()
            self._ready.set()
            await task

        self.loop.run_until_complete(main())

    def __enter__(self) -> RPCThread:
        self.thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the RPC server did not start")
        self.address = self.rpc.bound_address
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.rpc.request_stop)
        self.thread.join(timeout=30)


def wait_idle(llm, timeout: float = 20.0) -> None:
    """Wait until the engine runs nothing and holds no KV blocks."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = llm.metrics()
        if m.num_running == 0 and m.num_waiting == 0 and m.kv_usage == 0.0:
            return
        time.sleep(0.05)
    m = llm.metrics()
    raise AssertionError(f"engine not idle: running={m.num_running} kv={m.kv_usage}")


def stop_process(proc: subprocess.Popen) -> str:
    """Kill a server process if it still runs; its output (stdout, with stderr in it)."""
    if proc.poll() is None:
        proc.kill()
    out, _ = proc.communicate(timeout=30)
    return out.decode(errors="replace")


def wait_healthy(proc: subprocess.Popen, base: str, timeout_s: float) -> None:
    """Until ``base``/health answers 200; fails with the process's output if it exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, stop_process(proc)
        assert time.monotonic() < deadline, "the server did not start"
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
