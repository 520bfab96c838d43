"""Python clients for the ZeroMQ RPC server (``engine rpc``): ``RPCClient`` (blocking) and
``AsyncRPCClient`` (asyncio). Both talk msgpack over a DEALER socket, never pickle, and put a
deadline on every wait.

The protocol, and its messages, are in engine/server/rpc_messages.py.

Parameters are ``SamplingParams`` fields, given as a SamplingParams, a map, or keywords. A
structured-output constraint is its ``structured_outputs`` field: a ``StructuredOutputs``
(engine/structured/params.py) or a map of its fields, exactly one of ``json`` (a JSON schema, as
a map or JSON text), ``json_object``, ``regex``, ``choice`` (a list of strings) or ``grammar``
(GBNF or Lark), and optionally ``disable_any_whitespace``::

    client.generate("A user as JSON:", max_tokens=64, temperature=0,
                    structured_outputs={"json": {"type": "object", ...}})

The server compiles it off its event loop before the engine sees it; an invalid constraint, one
over a size cap or one that does not compile within the deadline is an ``RPCError`` with code
400 and ``param`` "structured_outputs"; code 503 when too many compiles are pending.

``priority`` (keyword, beside the parameters as in vLLM, not one of them): an int, 0 by default;
a server started with ``--scheduling-policy priority`` serves lower values first. A server under
fcfs answers any other value with an ``RPCError`` of code 400 and ``param`` "priority".
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from engine.ipc import curve
from engine.ipc.codec import CodecError
from engine.ipc.wire import params_to_wire
from engine.sampling_params import SamplingParams
from engine.server import rpc_messages as r
from engine.server.rpc_messages import MAX_MESSAGE_BYTES, OPS  # noqa: F401
from engine.server.rpc_results import (  # noqa: F401 (the clients' results, re-exported)
    Completion,
    GenerateResult,
    RPCError,
    RPCTimeoutError,
    StreamDelta,
    TokenLogprob,
    Usage,
    completion_from_wire,
    result_from_wire,
)
from engine.structured.params import StructuredOutputs

DEFAULT_ADDRESS = "tcp://127.0.0.1:5555"
DEFAULT_TIMEOUT_S = 120.0
MAX_BUFFERED = 10_000  # replies held for one call before the call fails (a consumer too slow)


# -- encoding ------------------------------------------------------------------------------------


def pack(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=True)


def params_dict(params=None, **kwargs) -> dict:
    """SamplingParams (or a dict) plus keyword overrides, as plain msgpack-able values."""
    out: dict = {}
    if isinstance(params, SamplingParams):
        out = params_to_wire(params)
    elif params is not None:
        if dataclasses.is_dataclass(params):
            out = {
                f.name: getattr(params, f.name)
                for f in dataclasses.fields(params)
                if f.name != "extra"
            }
        else:
            out = dict(params)
    out.update(kwargs)
    so = out.get("structured_outputs")
    if isinstance(so, StructuredOutputs):
        out["structured_outputs"] = so.to_dict()
    return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def _pack_request(msg: r.Request) -> bytes:
    (data,) = r.REQUESTS.encode(msg)
    if len(data) > MAX_MESSAGE_BYTES:  # fail here rather than wait for the server's 413
        raise RPCError(
            f"a request must be at most {MAX_MESSAGE_BYTES} bytes, got {len(data)}",
            413,
            "RequestTooLargeError",
        )
    return data


def _unreachable(address: str) -> RPCError:
    # The socket's send queue is full: the server has not been taking messages for a while.
    return RPCError(f"cannot send to {address}: the server is not taking requests", 503)


def _overflow_reply() -> r.Error:
    message = f"more than {MAX_BUFFERED} replies were buffered for one call; it was dropped"
    return r.Error(None, {"message": message, "type": "OverflowError", "code": 500})


def _request(
    stream: bool, prompt, params, kwargs, request_id, cache_salt, timeout, priority
) -> r.Generate:
    """The call's message: ``params`` (SamplingParams, a map or None) with the ``kwargs``
    overrides, and the call's options."""
    if isinstance(priority, int) and not -(2**63) <= priority < 2**63:  # not for the wire
        message = f"priority must be in [-2**63, 2**63 - 1], got {priority}"
        raise RPCError(message, 400, "BadRequestError", "priority")
    kind = r.Stream if stream else r.Generate
    request_id = request_id or uuid.uuid4().hex
    return kind(
        prompt=prompt,
        params=params_dict(params, **kwargs),
        request_id=request_id,
        cache_salt=cache_salt,
        timeout=timeout,
        priority=priority,
    )


def _read_reply(data: bytes) -> r.Reply | None:
    """A reply, or None for a frame that is not one (the waiting call times out)."""
    try:
        return r.REPLIES.decode([data])  # type: ignore[return-value]
    except CodecError:
        return None


def _ok_fields(reply: r.Ok) -> dict:
    return {
        f.name: getattr(reply, f.name)
        for f in dataclasses.fields(reply)
        if f.name not in ("id", "frames") and getattr(reply, f.name) is not None
    }


# -- blocking client -------------------------------------------------------------------------------


class RPCClient:
    """Blocking client. Calls from several threads are safe (one lock around the socket); a
    stream being read interleaves with other calls, replies are routed by call id."""

    def __init__(self, address: str = DEFAULT_ADDRESS, timeout: float = DEFAULT_TIMEOUT_S):
        self.address = address
        self.timeout = timeout
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        curve.secure_client(self._sock)
        self._sock.connect(address)
        self._ids = itertools.count(1)
        self._inbox: dict[int, deque] = {}
        self._lock = threading.RLock()

    def close(self) -> None:
        with self._lock:
            self._sock.close(linger=0)

    def __enter__(self) -> RPCClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompt, params=None, *, request_id=None, cache_salt=None, timeout=None,
                 priority=0, **kwargs) -> GenerateResult:  # fmt: skip
        timeout = timeout or self.timeout
        msg = _request(False, prompt, params, kwargs, request_id, cache_salt, timeout, priority)
        return result_from_wire(self._call(msg, timeout))

    def stream(self, prompt, params=None, *, request_id=None, cache_salt=None, timeout=None,
               priority=0, **kwargs) -> Iterator[StreamDelta]:  # fmt: skip
        """Yield deltas as they come; closing the iterator early aborts the request."""
        timeout = timeout or self.timeout
        msg = _request(True, prompt, params, kwargs, request_id, cache_salt, timeout, priority)
        call_id, box = self._send(msg)
        deadline = time.monotonic() + timeout
        done = False
        try:
            while True:
                reply = self._recv(box, deadline)
                if isinstance(reply, r.Done):
                    done = True
                    return
                if isinstance(reply, r.Error):
                    done = True
                    raise RPCError.from_reply(reply)
                if isinstance(reply, r.Chunk):
                    yield StreamDelta(
                        reply.request_id, [completion_from_wire(c) for c in reply.outputs]
                    )
        finally:
            self._inbox.pop(call_id, None)
            if not done:
                self._fire(r.Abort(request_id=msg.request_id))

    def abort(self, request_id: str, timeout: float | None = None) -> bool:
        return bool(self._call(r.Abort(request_id=request_id), timeout).aborted)

    def health(self, timeout: float | None = None) -> dict:
        return _ok_fields(self._call(r.Health(), timeout))

    def metrics(self, timeout: float | None = None) -> dict:
        return self._call(r.Metrics(), timeout).metrics

    # -- plumbing ------------------------------------------------------------------------------

    def _send(self, msg: r.Request) -> tuple[int, deque]:
        with self._lock:
            call_id = next(self._ids)
            box: deque = deque()
            try:
                self._sock.send(_pack_request(replace(msg, id=call_id)), flags=zmq.NOBLOCK)
            except zmq.Again:
                raise _unreachable(self.address) from None
            self._inbox[call_id] = box
        return call_id, box

    def _fire(self, msg: r.Request) -> None:
        """Send without waiting for the reply (best effort: aborts on the way out)."""
        with self._lock:
            try:
                self._sock.send(_pack_request(replace(msg, id=next(self._ids))), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def _call(self, msg: r.Request, timeout: float | None):
        call_id, box = self._send(msg)
        try:
            reply = self._recv(box, time.monotonic() + (timeout or self.timeout))
        finally:
            self._inbox.pop(call_id, None)
        if isinstance(reply, r.Error):
            raise RPCError.from_reply(reply)
        return reply

    def _recv(self, box: deque, deadline: float) -> r.Reply:
        while True:
            if box:
                return box.popleft()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RPCTimeoutError(f"no reply from {self.address} before the deadline", 408)
            with self._lock:
                if box:
                    continue
                if not self._sock.poll(min(remaining, 0.05) * 1000, zmq.POLLIN):
                    continue
                data = self._sock.recv()
            reply = _read_reply(data)
            target = None if reply is None else self._inbox.get(reply.id)
            if target is None:
                continue  # a call that was given up on, or not a reply
            if len(target) >= MAX_BUFFERED:  # its reader is too slow: fail that call
                target.clear()
                target.append(_overflow_reply())
                self._inbox.pop(reply.id, None)
                continue
            target.append(reply)


# -- asyncio client ----------------------------------------------------------------------------


class AsyncRPCClient:
    """asyncio client: one reader task routes replies to per-call bounded queues."""

    def __init__(self, address: str = DEFAULT_ADDRESS, timeout: float = DEFAULT_TIMEOUT_S):
        self.address = address
        self.timeout = timeout
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        curve.secure_client(self._sock)
        self._sock.connect(address)
        self._ids = itertools.count(1)
        self._inbox: dict[int, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._sock.close(linger=0)

    async def __aenter__(self) -> AsyncRPCClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def generate(self, prompt, params=None, *, request_id=None, cache_salt=None, timeout=None,
                       priority=0, **kwargs) -> GenerateResult:  # fmt: skip
        timeout = timeout or self.timeout
        msg = _request(False, prompt, params, kwargs, request_id, cache_salt, timeout, priority)
        return result_from_wire(await self._call(msg, timeout))

    async def stream(self, prompt, params=None, *, request_id=None, cache_salt=None, timeout=None,
                     priority=0, **kwargs) -> AsyncIterator[StreamDelta]:  # fmt: skip
        timeout = timeout or self.timeout
        msg = _request(True, prompt, params, kwargs, request_id, cache_salt, timeout, priority)
        call_id, queue = await self._send(msg)
        deadline = time.monotonic() + timeout
        done = False
        try:
            while True:
                reply = await self._recv(queue, deadline)
                if isinstance(reply, r.Done):
                    done = True
                    return
                if isinstance(reply, r.Error):
                    done = True
                    raise RPCError.from_reply(reply)
                if isinstance(reply, r.Chunk):
                    yield StreamDelta(
                        reply.request_id, [completion_from_wire(c) for c in reply.outputs]
                    )
        finally:
            self._inbox.pop(call_id, None)
            if not done:
                await self._fire(r.Abort(request_id=msg.request_id))

    async def abort(self, request_id: str, timeout: float | None = None) -> bool:
        reply = await self._call(r.Abort(request_id=request_id), timeout)
        return bool(reply.aborted)

    async def health(self, timeout: float | None = None) -> dict:
        return _ok_fields(await self._call(r.Health(), timeout))

    async def metrics(self, timeout: float | None = None) -> dict:
        return (await self._call(r.Metrics(), timeout)).metrics

    # -- plumbing ------------------------------------------------------------------------------

    async def _send(self, msg: r.Request) -> tuple[int, asyncio.Queue]:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.ensure_future(self._read())
        call_id = next(self._ids)
        queue: asyncio.Queue = asyncio.Queue(MAX_BUFFERED)
        try:
            await self._sock.send(_pack_request(replace(msg, id=call_id)), flags=zmq.NOBLOCK)
        except zmq.Again:
            raise _unreachable(self.address) from None
        self._inbox[call_id] = queue
        return call_id, queue

    async def _fire(self, msg: r.Request) -> None:
        try:
            await self._sock.send(_pack_request(replace(msg, id=next(self._ids))), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    async def _call(self, msg: r.Request, timeout: float | None):
        call_id, queue = await self._send(msg)
        try:
            reply = await self._recv(queue, time.monotonic() + (timeout or self.timeout))
        finally:
            self._inbox.pop(call_id, None)
        if isinstance(reply, r.Error):
            raise RPCError.from_reply(reply)
        return reply

    async def _recv(self, queue: asyncio.Queue, deadline: float) -> r.Reply:
        remaining = deadline - time.monotonic()
        try:
            reply = await asyncio.wait_for(queue.get(), max(remaining, 0.0))
        except asyncio.TimeoutError:
            raise RPCTimeoutError(
                f"no reply from {self.address} before the deadline", 408
            ) from None
        if isinstance(reply, BaseException):
            raise reply
        return reply

    async def _read(self) -> None:
        while True:
            reply = _read_reply(await self._sock.recv())
            queue = None if reply is None else self._inbox.get(reply.id)
            if queue is None:
                continue  # not a reply, or one for a call that was given up on
            try:
                queue.put_nowait(reply)
            except asyncio.QueueFull:  # its reader is too slow: fail that call
                self._inbox.pop(reply.id, None)
                while not queue.empty():
                    queue.get_nowait()
                queue.put_nowait(_overflow_reply())
