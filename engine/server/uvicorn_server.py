"""Running the HTTP server: uvicorn with our connection limits, a socket bound before the model
loads, and a graceful drain on the first SIGTERM/SIGINT (http_server.py builds the app)."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import time

import uvicorn
from fastapi import FastAPI

from engine.server.http_limits import HTTPLimits, protocol_class
from engine.server.http_server import build_app

logger = logging.getLogger("engine.server")


class DrainingServer(uvicorn.Server):
    """uvicorn, with a graceful drain on the first SIGTERM/SIGINT: the app answers 503 while
    in-flight requests finish (until ``drain_timeout``), then uvicorn shuts down. A second
    signal moves the engine's deadline to now: everything in flight is aborted at the end of
    the current step (clients get ``finish_reason: "abort"``) and the server exits as after a
    drain. uvicorn's own handler would re-raise the signal after shutdown and so never exit 0,
    and its force-exit would leave the engine thread inside a step while the interpreter exits
    (a C++ abort, exit code 134)."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout: float) -> None:
        super().__init__(config)
        self._app = app
        self.drain_timeout = drain_timeout
        self._signals = 0
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame) -> None:
        self._signals += 1  # acted on in on_tick, on the event loop (not in the handler)

    async def on_tick(self, counter: int) -> bool:
        if self._signals and self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self.drain())
        if self._signals > 1:
            self._app.state.llm.set_deadline(time.monotonic())
        return await super().on_tick(counter)

    async def drain(self) -> None:
        started = time.monotonic()
        self._app.state.server.draining = True
        llm = self._app.state.llm
        logger.info("draining: %d request(s) in flight", getattr(llm, "num_in_flight", -1))
        await llm.shutdown(timeout=self.drain_timeout)
        logger.info("drained in %.1f s; shutting down", time.monotonic() - started)
        self.should_exit = True


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound now; ValueError in one line if the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def uvicorn_config(app: FastAPI, limits: HTTPLimits | None = None, **kwargs) -> uvicorn.Config:
    """uvicorn's config for ``app`` with our connection limits and read deadlines."""
    limits = limits or HTTPLimits()
    rejections = getattr(app.state, "rejections", None)
    return uvicorn.Config(
        app,
        http=protocol_class(limits, rejections.add if rejections else lambda reason: None),
        limit_concurrency=None,  # replaced by the protocol's caps, which answer 429
        timeout_keep_alive=limits.keep_alive_s,
        h11_max_incomplete_event_size=limits.max_head_bytes,
        lifespan="on",
        **kwargs,
    )


def serve_http(
    llm,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_names: list[str] | None = None,
    api_key: str | None = None,
    drain_timeout: float = 30.0,
    log_level: str = "info",
    access_log: bool = False,
    limits: HTTPLimits | None = None,
    sock: socket.socket | None = None,
    enable_docs: bool = True,
    model_root: str | None = None,
    max_pending_per_client: int | None = None,
    tool_call_parser: str | None = None,
    responses=None,
) -> int:
    """Serve until SIGTERM/SIGINT, drain, return 0. Blocks the calling (main) thread.
    ``sock``: a socket bound already (``bind_socket``), so that a port in use is found before
    the model loads. ``responses``: a ResponsesConfig (responses/store.py)."""
    app = build_app(
        llm,
        served_model_names or [str(llm.model_path)],
        api_key,
        enable_docs=enable_docs,
        model_root=model_root,
        max_pending_per_client=max_pending_per_client,
        tool_call_parser=tool_call_parser,
        responses=responses,
    )
    config = uvicorn_config(
        app,
        limits,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=5,
    )
    server = DrainingServer(config, app, drain_timeout)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, server.handle_exit)  # also covers a signal before uvicorn starts
    try:
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        llm.close()  # the engine thread must not be inside a step while the interpreter exits
    return 0
