"""The router's sockets and its one IO thread.

The thread owns the ROUTER socket (workers' control messages), the SUB socket (block events of
workers and pool services) and everything the router keeps: callers on any thread or asyncio
loop hand it commands through a deque and a wake pipe. Each frame from a socket is decoded here
(typed messages, typed block events: nothing from a socket is unpickled); a bad one costs that
message, logged, never the thread. The thread ticks ten times a second for the deadlines.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Protocol

import zmq

from engine.cluster import messages as m
from engine.cluster.router.commands import RouterCommand
from engine.ipc import curve
from engine.ipc.liveness import watch_peer
from engine.kvstore.block_events import BlockEvent, BlockEventError

log = logging.getLogger(__name__)

TICK_S = 0.1
BATCH = 10_000  # messages taken from one socket before the others get a turn
EVENT_BYTES = 1 << 20


class Handler(Protocol):
    """What the IO thread calls, always on itself."""

    def on_message(self, identity: bytes, msg: m.Message, now: float) -> None: ...

    def on_block_event(self, event: BlockEvent) -> None: ...

    def on_command(self, command: RouterCommand) -> None: ...

    def on_tick(self, now: float) -> None: ...

    def on_stop(self) -> None: ...


class Peer(Protocol):
    worker_id: str
    identity: bytes


class RouterIO:
    def __init__(self, address: str) -> None:
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        self._sock.setsockopt(zmq.MAXMSGSIZE, m.MAX_HEADER_BYTES + 1024)
        watch_peer(self._sock)  # a worker back from a partition takes its identity over
        curve.secure_server(self._sock, address)
        self._sock.bind(address)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._events = self._ctx.socket(zmq.SUB)
        self._events.setsockopt(zmq.LINGER, 0)
        self._events.setsockopt(zmq.MAXMSGSIZE, EVENT_BYTES)
        self._events.setsockopt(zmq.SUBSCRIBE, b"")
        curve.secure_client(self._events)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._commands: deque = deque()
        self._stop = False
        self.thread: threading.Thread | None = None

    def start(self, handler: Handler) -> None:
        self.thread = threading.Thread(
            target=self._loop, args=(handler,), name="router-io", daemon=True
        )
        self.thread.start()

    def is_alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    # -- any thread -------------------------------------------------------------------------

    def command(self, command: RouterCommand) -> None:
        self._commands.append(command)
        self._wake()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread (idempotent): the handler's ``on_stop`` runs, the sockets close."""
        if not self.is_alive():
            return
        self._stop = True
        self._wake()
        self.thread.join(timeout=timeout)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full of wakes already, or the thread stopped

    # -- the IO thread ----------------------------------------------------------------------

    def send(self, peer: Peer, msg: m.Message) -> bool:
        try:
            self._sock.send_multipart([peer.identity, *m.encode(msg)], zmq.NOBLOCK)
            return True
        except (zmq.Again, zmq.ZMQError) as exc:
            log.warning("cannot send %s to %s: %s", msg.TYPE, peer.worker_id, exc)
            return False

    def subscribe(self, address: str) -> bool:
        try:
            self._events.connect(address)
            return True
        except zmq.ZMQError as exc:  # block events are a hint: serve without them
            log.warning("cannot subscribe to %r: %s", address[:200], exc)
            return False

    def unsubscribe(self, address: str) -> None:
        try:
            self._events.disconnect(address)
        except zmq.ZMQError:
            pass

    def _loop(self, handler: Handler) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self._events, zmq.POLLIN)
        next_tick = 0.0
        try:
            while not self._stop:
                ready = dict(poller.poll(int(TICK_S * 1000)))
                if self._wake_r in ready:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                if self._sock in ready:
                    self._take_messages(handler)
                if self._events in ready:
                    self._take_events(handler)
                while self._commands:
                    handler.on_command(self._commands.popleft())
                now = time.monotonic()
                if now >= next_tick:
                    next_tick = now + TICK_S
                    handler.on_tick(now)
        except Exception:
            log.exception("router IO thread died")
            raise
        finally:
            handler.on_stop()
            self._sock.close(linger=0)
            self._events.close(linger=0)
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _take_messages(self, handler: Handler) -> None:
        for _ in range(BATCH):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            identity = frames[0]
            try:
                msg = m.decode(frames[1:])
            except m.MessageError as exc:
                log.warning("bad message from %r: %s", identity[:64], exc)
                continue
            try:
                handler.on_message(identity, msg, time.monotonic())
            except Exception:  # one bad message costs that message, not the router
                log.exception("a message from %r failed", identity[:64])

    def _take_events(self, handler: Handler) -> None:
        for _ in range(BATCH):
            try:
                frame = self._events.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                event = BlockEvent.from_wire(frame)
            except BlockEventError as exc:  # a hint source must never stop the router
                log.debug("a malformed block event: %s", exc)
                continue
            try:
                handler.on_block_event(event)
            except Exception:
                log.exception("a block event of %r failed", event.source[:64])
