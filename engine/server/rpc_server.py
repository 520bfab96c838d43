"""The ZeroMQ RPC server: a ROUTER socket, msgpack messages, streamed replies (the protocol is
engine/server/rpc_messages.py; the clients are engine/server/rpc_client.py).

All socket IO runs on one asyncio loop (zmq.asyncio); each generate/stream call is a task that
drives one engine request. Replies are sent without blocking: a peer that is gone or reads too
slowly to keep up (its send queue is full) has its calls aborted, so a dead client never holds
KV blocks. A frame that is not a valid request gets an error reply; nothing a client sends can
stop the loop. Every call has a deadline, enforced here as well as in the client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import signal
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass

import zmq
import zmq.asyncio

from engine.errors import RequestError
from engine.ipc import curve
from engine.ipc.codec import CodecError, problem
from engine.ipc.wire import output_to_wire, params_from_wire
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.server import rpc_messages as r
from engine.server.errors import APIError, to_api_error
from engine.server.openai_protocol import MAX_N
from engine.server.rpc_client import DEFAULT_ADDRESS
from engine.server.streams import check_whole, checked, moved_once
from engine.server.tokenize_pool import Offloader, check_prompt_chars

logger = logging.getLogger("engine.server.rpc")

MAX_MESSAGE_BYTES = r.MAX_MESSAGE_BYTES  # a larger request gets a 413 error reply
HARD_MAX_MESSAGE_BYTES = 4 * MAX_MESSAGE_BYTES  # zmq drops a peer that sends more (no reply)
# Replies queued per peer before the peer counts as too slow and its calls are aborted. With
# ids and request ids bounded (MAX_ID_CHARS), a stream chunk is a few hundred bytes, so a peer
# that never reads holds at most about SEND_HWM * 1 KB of the server's memory (one result of a
# huge n can be larger; it is one message).
SEND_HWM = 1000
RECV_HWM = 1000  # requests queued before the receive loop takes them (it never blocks long)
MAX_ID_CHARS = r.MAX_ID_CHARS


@dataclass
class _Call:
    peer: tuple[bytes, ...]  # identity frame and envelope, to address the replies
    call_id: object
    request_id: str  # the client's name for it (scoped to the client)
    engine_id: str  # the engine's name for it (unique)
    stream: bool
    task: asyncio.Task | None = None
    expired: bool = False
    aborted: bool = False  # its client asked (an abort op): "abort" is then its answer


def rpc_params(raw) -> SamplingParams:
    """SamplingParams from a request's untrusted map (engine/ipc/wire.py checks the fields and
    their types), less what the RPC API refuses: prompt logprobs, n over MAX_N, and a seed that
    the choices' seeds (seed + i) would carry past 64 bits."""
    if isinstance(raw, dict) and raw.get("prompt_logprobs") is not None:
        # The RPC result has no place for them yet; refused rather than dropped.
        raise RequestError(
            "prompt_logprobs is not supported over RPC (the HTTP server has it)", "prompt_logprobs"
        )
    params = params_from_wire(raw)
    if params.n > MAX_N:
        raise RequestError(f"n must be <= {MAX_N}, got {params.n}", "n")
    seed = params.seed
    if seed is not None and not -(2**63) <= seed <= 2**63 - 1 - MAX_N:
        raise RequestError(f"seed must be in [-2**63, 2**63 - {MAX_N + 1}], got {seed}", "seed")
    return params


def _echo_id(header: dict | None):
    """The call id to put in an error reply: the request's, unless it is not a valid one
    (echoing it back would amplify what the peer sent)."""
    call_id = header.get("id") if isinstance(header, dict) else None
    return call_id if problem(call_id, r.CallId) is None else None


def _usage(out: RequestOutput | None) -> dict:
    if out is None:
        return {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
    return {
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": sum(len(c.token_ids) for c in out.outputs),
        "cached_tokens": out.metrics.num_cached_tokens if out.metrics else 0,
    }


class RPCServer:
    def __init__(
        self,
        llm,
        address: str = DEFAULT_ADDRESS,
        model_name: str | None = None,
        max_inflight: int = 1024,
        default_timeout: float = 600.0,
        max_timeout: float = 3600.0,
        drain_timeout: float = 30.0,
        shutdown_engine: bool = True,
        send_hwm: int = SEND_HWM,
        send_buffer_bytes: int = -1,
    ) -> None:
        self.llm = llm
        self.send_hwm = send_hwm
        self.send_buffer_bytes = send_buffer_bytes  # the kernel's SO_SNDBUF; -1: the OS default
        self.address = address
        self.model_name = model_name or str(llm.model_path)
        self.max_inflight = max_inflight
        self.default_timeout = default_timeout
        self.max_timeout = max_timeout
        self.drain_timeout = drain_timeout
        self.shutdown_engine = shutdown_engine
        self.bound_address: str | None = None  # the endpoint actually bound (port 0 resolved)
        self.draining = False
        self._calls: dict[tuple[bytes, str], _Call] = {}
        self._offload = Offloader()
        self._stop = asyncio.Event()
        self._sock: zmq.asyncio.Socket | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Begin the drain (call it on the server's loop: call_soon_threadsafe from others)."""
        self._stop.set()

    async def serve(self, ready: asyncio.Event | None = None) -> None:
        """Bind, serve until request_stop(), then drain: new calls get 503, calls in flight
        finish until drain_timeout, the rest are aborted."""
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished peer raises
        sock.setsockopt(zmq.SNDHWM, self.send_hwm)
        sock.setsockopt(zmq.RCVHWM, RECV_HWM)
        sock.setsockopt(zmq.SNDBUF, self.send_buffer_bytes)
        sock.setsockopt(zmq.MAXMSGSIZE, HARD_MAX_MESSAGE_BYTES)
        curve.secure_server(sock, self.address)
        sock.bind(self.address)
        self._sock = sock
        self.bound_address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        logger.info("RPC server on %s", self.bound_address)
        receiver = asyncio.ensure_future(self._receive_loop())
        if ready is not None:
            ready.set()
        try:
            await self._stop.wait()
            await self._drain()
        finally:
            receiver.cancel()
            await asyncio.gather(receiver, return_exceptions=True)
            self._offload.close()
            sock.close(linger=1000)
            curve.stop_authenticator(ctx)
            ctx.term()

    async def _drain(self) -> None:
        self.draining = True
        tasks = [c.task for c in self._calls.values() if c.task is not None]
        logger.info("draining: %d call(s) in flight", len(tasks))
        if self.shutdown_engine:
            await self.llm.shutdown(timeout=self.drain_timeout)  # finishes or aborts them all
        elif tasks:
            await asyncio.wait(tasks, timeout=self.drain_timeout)
        if tasks:  # let the calls send their last replies (a stream's finish_reason "abort"; a
            # whole result cut short: a 503 error)
            await asyncio.wait(tasks, timeout=1.0)
        for t in tasks:
            t.cancel()  # aborts the engine request (no-op if finished)
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)

    # -- receiving ------------------------------------------------------------------------------

    async def _receive_loop(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            try:
                self._dispatch(frames)
            except Exception:  # never let one message stop the loop
                logger.exception("error handling an RPC message")

    def _dispatch(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            return  # nothing to reply to
        peer, payload = tuple(frames[:-1]), frames[-1]
        call_id = None
        try:
            if len(payload) > MAX_MESSAGE_BYTES:
                raise APIError(
                    413, f"a request must be at most {MAX_MESSAGE_BYTES} bytes, got {len(payload)}"
                )
            try:
                msg = r.REQUESTS.decode([payload])
            except CodecError as exc:
                call_id = _echo_id(exc.header)
                raise APIError(400, str(exc), exc.field) from None
            call_id = msg.id
            if isinstance(msg, r.Generate):
                self._start_call(peer, msg)
            elif isinstance(msg, r.Abort):
                self._abort(peer, msg)
            elif isinstance(msg, r.Health):
                self._health(peer, call_id)
            else:
                metrics = dataclasses.asdict(self.llm.metrics())
                self._send(peer, r.Ok(call_id, metrics=metrics))
        except Exception as exc:  # bad input: its status; anything else: 500, logged
            self._send_error(peer, call_id, to_api_error(exc))

    def _start_call(self, peer, msg: r.Generate) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down")
        if len(self._calls) >= self.max_inflight:
            raise APIError(429, f"too many calls in flight ({self.max_inflight}); retry later")
        params = rpc_params(msg.params)
        request_id = msg.request_id or uuid.uuid4().hex
        timeout = self.default_timeout if msg.timeout is None else msg.timeout
        if not (math.isfinite(timeout) and 0 < timeout <= self.max_timeout):
            raise RequestError(
                f"timeout must be in (0, {self.max_timeout}] seconds, got {timeout}", "timeout"
            )
        key = (peer[0], request_id)
        if key in self._calls:
            raise RequestError(f"request_id {request_id!r} is already in use", "request_id")
        stream = isinstance(msg, r.Stream)
        call = _Call(peer, msg.id, request_id, f"rpc-{uuid.uuid4().hex}", stream)
        self._calls[key] = call
        call.task = asyncio.ensure_future(
            self._run_call(key, call, msg.prompt, params, msg.cache_salt, msg.priority)
        )
        loop = asyncio.get_running_loop()
        timer = loop.call_later(timeout, self._expire, call)
        call.task.add_done_callback(lambda _: timer.cancel())

    def _expire(self, call: _Call) -> None:
        if call.task is not None and not call.task.done():
            call.expired = True
            call.task.cancel()

    async def _run_call(self, key, call: _Call, prompt, params, salt, priority=0) -> None:
        last: RequestOutput | None = None
        try:
            if isinstance(prompt, str):  # tokenized off the event loop, after a cheap bound
                check_prompt_chars(
                    len(prompt), self.llm.tokenizer, self.llm.max_model_len, "prompt"
                )
                prompt = await self._offload(self.llm.tokenizer.encode, prompt)
            if params.structured_outputs is not None:  # compiled off this loop, then cached
                await self.llm.compile_grammar(params)
            gen = checked(  # an output stream cut short, an engine's own finish reason: 503
                self.llm.generate(
                    prompt, params, request_id=call.engine_id, cache_salt=salt, priority=priority
                ),
                call.request_id,
            )
            ended: set[int] = set()  # choices whose last chunk went out (a finish reason once)
            async with aclosing(gen):
                async for out in gen:
                    last = out
                    if not call.stream:
                        continue
                    moved = [
                        output_to_wire(c) for c in out.outputs if moved_once(c, c.index, ended)
                    ]
                    chunk = r.Chunk(call.call_id, call.request_id, moved)
                    if moved and not self._send(call.peer, chunk):
                        return  # the peer is gone or stuck: closing gen aborts the request
            if call.stream:
                self._send(call.peer, r.Done(call.call_id, call.request_id, _usage(last)))
            else:
                assert last is not None  # checked: it ended on a finished output
                if not call.aborted:  # the server's shutdown aborted it: no partial answer
                    check_whole(last, call.request_id)
                outputs = [output_to_wire(c, delta=False) for c in last.outputs]
                reply = r.Result(call.call_id, call.request_id, outputs, _usage(last))
                self._send(call.peer, reply)
        except asyncio.CancelledError:
            if not call.expired:
                raise
            self._send_error(call.peer, call.call_id, APIError(408, "the call's deadline passed"))
        except Exception as exc:
            self._send_error(call.peer, call.call_id, to_api_error(exc))
        finally:
            self._calls.pop(key, None)

    def _abort(self, peer, msg: r.Abort) -> None:
        call = self._calls.get((peer[0], msg.request_id))
        if call is not None:
            call.aborted = True
            asyncio.ensure_future(self.llm.abort(call.engine_id))
        self._send(peer, r.Ok(msg.id, aborted=call is not None))

    def _health(self, peer, call_id) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down")
        if not self.llm.is_healthy():
            raise APIError(503, "the engine is not running")
        reply = r.Ok(
            call_id,
            healthy=True,
            model=self.model_name,
            max_model_len=self.llm.max_model_len,
            num_calls=len(self._calls),
        )
        self._send(peer, reply)

    # -- sending ----------------------------------------------------------------------------------

    def _send(self, peer: tuple[bytes, ...], msg: r.Reply) -> bool:
        """Send without blocking; False (and the peer's calls aborted) if it cannot take it."""
        assert self._sock is not None
        fut = self._sock.send_multipart([*peer, *r.REPLIES.encode(msg)], flags=zmq.DONTWAIT)
        exc = fut.exception() if fut.done() else None
        if exc is None:
            return True
        logger.warning("dropping peer %r: %s", peer[0], exc)
        for key, call in list(self._calls.items()):
            if key[0] == peer[0] and call.task is not None:
                call.task.cancel()
        return False

    def _send_error(self, peer, call_id, err: APIError) -> None:
        self._send(peer, r.Error(call_id, err.body()["error"]))


def check_address(address: str) -> None:
    """Bind ``address`` and let it go: ValueError in one line if it is malformed or taken."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        raise ValueError(f"cannot bind the RPC address {address!r}: {exc}") from None
    finally:
        sock.close(linger=0)
        ctx.term()
    curve.require_auth(address)  # beyond loopback without keys: said before the model loads


def serve_rpc(llm, address: str = DEFAULT_ADDRESS, drain_timeout: float = 30.0, **kwargs) -> int:
    """Serve until SIGTERM/SIGINT, drain, return 0. Blocks the calling (main) thread. A second
    signal aborts everything in flight at the end of the engine's current step, then exits."""

    async def main() -> None:
        server = RPCServer(llm, address, drain_timeout=drain_timeout, **kwargs)
        loop = asyncio.get_running_loop()
        signals = []

        def on_signal() -> None:  # the first drains, a second aborts everything now
            signals.append(1)
            if len(signals) == 1:
                server.request_stop()
            else:
                logger.warning("second signal: aborting everything in flight")
                llm.set_deadline(time.monotonic())

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        await server.serve()

    try:
        asyncio.run(main())
    finally:
        llm.close()  # the engine thread must not be inside a step while the interpreter exits
    return 0
