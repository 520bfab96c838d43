"""Connection limits for the HTTP server: read deadlines, a cap on connections in all and per
client, and a 429 (not uvicorn's plain-text 503) when a cap is reached.

uvicorn (h11) bounds a request head's size but not the time it takes to arrive, and its
``limit_concurrency`` answers every request with a plain-text 503 once the connections are all
taken, ``/health`` included. So 2,047 clients that send headers and then a byte every few
seconds lock everyone out. Here, as a uvicorn protocol class:

- a request's head must arrive within ``header_timeout_s`` of its first byte (of the connection,
  for the first request) and its body within ``body_timeout_s`` after the head; otherwise the
  client gets a 408 and the connection is closed;
- a client address already at its cap may open ``new_connections_per_client_s`` more a second
  (after a burst); more are reset at once, before any parsing;
- when a new connection would exceed ``max_connections`` (or ``max_connections_per_client`` for
  its address), the connection that has been stalled longest in the middle of sending a request
  (for at least ``stall_s``) is closed with a 408 to make room; failing that, an idle keep-alive
  connection is closed, or (at the global cap) the oldest reader of the address that holds the
  most connections; failing all that, the new connection's requests get an OpenAI-shaped
  429 with ``Retry-After`` (``/health`` is still answered) and it is closed after the answer.

A well-behaved client sends its request at once and is never stalled, so it only meets these
limits when the server is really full, and then it gets the documented 429.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.server.errors import RETRY_AFTER_S, error_body


@dataclass(frozen=True)
class HTTPLimits:
    max_connections: int = 2048
    max_connections_per_client: int = 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    stall_s: float = 2.0  # a request incomplete for this long may be closed to make room
    # New connections per second from an address already at max_connections_per_client, after
    # a burst of max_connections: more are reset at once, which costs the server almost nothing
    # (a slowloris attacker that reconnects as fast as it is closed would otherwise keep the
    # event loop busy). Below its cap, a client is not rate-limited.
    new_connections_per_client_s: float = 50.0
    keep_alive_s: float = 5.0  # idle time before uvicorn closes a keep-alive connection
    max_head_bytes: int = 16 * 1024  # request line + headers (h11's limit)

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_connections_per_client", "max_head_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "header_timeout_s",
            "body_timeout_s",
            "stall_s",
            "keep_alive_s",
            "new_connections_per_client_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class _Table:
    """The open connections (one table per server): all of them, by client address, and, in
    the order they began, those reading a request and those idle between requests, so that
    finding the longest-stalled reader or the oldest idle connection is O(1) even when an
    attacker churns through thousands of connections a second."""

    def __init__(self) -> None:
        self.all: set[GuardedH11Protocol] = set()
        self.by_host: dict[str, set[GuardedH11Protocol]] = {}
        self.reading: dict[GuardedH11Protocol, None] = {}  # insertion order: reading_since
        self.reading_by_host: dict[str, dict[GuardedH11Protocol, None]] = {}
        self.idle: dict[GuardedH11Protocol, None] = {}
        self.idle_by_host: dict[str, dict[GuardedH11Protocol, None]] = {}

        self.buckets: dict[str, tuple[float, float]] = {}  # host -> (tokens, when)

    def admit(self, host: str, limits: HTTPLimits, now: float) -> bool:
        """Take a token from ``host``'s bucket; False when it is empty."""
        burst = float(limits.max_connections)
        tokens, when = self.buckets.get(host, (burst, now))
        tokens = min(burst, tokens + (now - when) * limits.new_connections_per_client_s)
        if tokens < 1.0:
            self.buckets[host] = (tokens, now)
            return False
        self.buckets[host] = (tokens - 1.0, now)
        return True

    def add(self, conn: GuardedH11Protocol) -> None:
        self.all.add(conn)
        self.by_host.setdefault(conn.host, set()).add(conn)

    def remove(self, conn: GuardedH11Protocol) -> None:
        self.all.discard(conn)
        _discard(self.by_host, conn.host, conn)
        if conn.host not in self.by_host and len(self.buckets) > 4 * len(self.by_host) + 1024:
            self.buckets.pop(conn.host, None)  # bounded: forget hosts that are gone
        self.mark(conn, "reading", False)
        self.mark(conn, "idle", False)

    def mark(self, conn: GuardedH11Protocol, kind: str, on: bool) -> None:
        everyone: dict = getattr(self, kind)
        per_host: dict = getattr(self, kind + "_by_host")
        if on:
            everyone[conn] = None
            per_host.setdefault(conn.host, {})[conn] = None
        else:
            everyone.pop(conn, None)
            _discard(per_host, conn.host, conn)

    def evict_one(self, host: str | None, now: float, stall_s: float, spare) -> bool:
        """Close the longest-stalled reader (of ``host``, or of anyone), else the oldest idle
        keep-alive connection; False if every connection is busy with a request it sent in
        time. ``spare``: the connection being made room for."""
        reading = self.reading if host is None else self.reading_by_host.get(host, {})
        victim = next((c for c in reading if c is not spare), None)
        if victim is not None and now - victim.reading_since >= stall_s:
            victim.fail(408, "the request arrived too slowly")
            return True
        idle = self.idle if host is None else self.idle_by_host.get(host, {})
        victim = next((c for c in idle if c is not spare), None)
        if victim is not None:
            victim.close_idle()
            return True
        return False


def _discard(table: dict, host: str, conn) -> None:
    group = table.get(host)
    if group is not None:
        if isinstance(group, set):
            group.discard(conn)
        else:
            group.pop(conn, None)
        if not group:
            del table[host]


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with read deadlines and connection caps (see the module doc).
    ``protocol_class`` binds the limits and the shared table."""

    limits: HTTPLimits
    table: _Table
    on_reject: Callable[[str], None]

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.limit_concurrency = None  # our caps replace uvicorn's plain-text 503
        self.host = self.client[0] if self.client else ""
        self.reading_since: float | None = None
        self._idle = False
        self._deadline = None
        self.table.add(self)
        now = time.monotonic()
        over = len(self.table.by_host[self.host]) > self.limits.max_connections_per_client
        if over and not self.table.admit(self.host, self.limits, now):
            self.on_reject("connection_rate")
            self.transport.abort()  # at its cap and reconnecting too fast: reset, no parsing
            return
        self._set_reading(True)  # awaiting the first request
        self._arm(self.limits.header_timeout_s)
        full = False
        if over:
            full = not self.table.evict_one(self.host, now, self.limits.stall_s, self)
        if not full and len(self.table.all) > self.limits.max_connections:
            full = not self.table.evict_one(None, now, self.limits.stall_s, self)
            if full:  # the address holding the most connections gives up its oldest reader
                heaviest = max(self.table.by_host, key=lambda h: len(self.table.by_host[h]))
                if heaviest != self.host:
                    full = not self.table.evict_one(heaviest, now, 0.0, self)
        if full:
            self.app = self._over_capacity  # answer its requests with a 429, then close
            self.on_reject("too_many_connections")

    def connection_lost(self, exc) -> None:
        self.table.remove(self)
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track()

    _served = 0  # responses completed on this connection

    def on_response_complete(self) -> None:
        self._served += 1
        super().on_response_complete()
        self._track()

    # -- deadlines --------------------------------------------------------------------------

    def _track(self) -> None:
        """Arm or clear the read deadline from h11's view of the client's side."""
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            if self.conn.trailing_data[0]:  # part of a new request's head has arrived
                self._set_idle(False)
                if self.reading_since is None:
                    self._set_reading(True)
                    self._arm(self.limits.header_timeout_s)
            elif self._served:  # between requests: uvicorn's keep-alive timeout applies
                self._set_reading(False)
                self._set_idle(self.cycle is None or self.cycle.response_complete)
                self._disarm()
            # else: the first request has not begun; the deadline armed at connect applies
        elif state is h11.SEND_BODY:
            self._set_idle(False)
            self._set_reading(True)
            if self._stage != "body":
                self._arm(self.limits.body_timeout_s, stage="body")
        else:  # DONE, MUST_CLOSE, CLOSED, ERROR: nothing left to read
            self._set_idle(False)
            self._set_reading(False)
            self._disarm()

    def _set_reading(self, on: bool) -> None:
        if on and self.reading_since is None:
            self.reading_since = time.monotonic()
            self.table.mark(self, "reading", True)
        elif not on and self.reading_since is not None:
            self.reading_since = None
            self.table.mark(self, "reading", False)

    def _set_idle(self, on: bool) -> None:
        if on != self._idle:
            self._idle = on
            self.table.mark(self, "idle", on)

    _stage = ""

    def _arm(self, seconds: float, stage: str = "head") -> None:
        self._disarm()
        self._stage = stage
        self._deadline = self.loop.call_later(seconds, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._stage = ""

    def _expire(self) -> None:
        self._deadline = None
        what = "request head" if self._stage == "head" else "request body"
        limit = (
            self.limits.header_timeout_s if self._stage == "head" else self.limits.body_timeout_s
        )
        self.fail(408, f"the {what} did not arrive within {limit:g} s")

    # -- closing ----------------------------------------------------------------------------

    def close_idle(self) -> None:
        self._set_idle(False)
        if not self.transport.is_closing():
            self.transport.close()

    def fail(self, status: int, message: str) -> None:
        """Answer ``status`` if nothing was sent yet, and close the connection."""
        self._disarm()
        self._set_reading(False)
        self._set_idle(False)
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app sees a disconnect; its sends are dropped
            self.cycle.message_event.set()
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE) and (
            self.cycle is None or not self.cycle.response_started
        ):
            body = json.dumps(error_body(status, message)).encode()
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ]
            try:
                if self.conn.our_state is h11.IDLE:  # h11 must have seen a request first
                    self.transport.write(_raw_response(status, headers, body))
                else:
                    self.transport.write(
                        self.conn.send(h11.Response(status_code=status, headers=headers))
                    )
                    self.transport.write(self.conn.send(h11.Data(data=body)))
                    self.transport.write(self.conn.send(h11.EndOfMessage()))
            except h11.LocalProtocolError:
                pass
        self.transport.close()

    async def _over_capacity(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] == "/health":
            await self.config.loaded_app(scope, receive, send)  # /health is always answered
            return
        message = (
            f"the server has too many open connections ({self.limits.max_connections} in all, "
            f"{self.limits.max_connections_per_client} per client); retry later"
        )
        body = json.dumps(error_body(429, message)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(RETRY_AFTER_S).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 429, "headers": headers})
        await send({"type": "http.response.body", "body": body})


_REASONS = {408: b"Request Timeout", 429: b"Too Many Requests"}


def _raw_response(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    lines = [b"HTTP/1.1 %d %s" % (status, _REASONS.get(status, b"Error"))]
    lines += [k + b": " + v for k, v in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def protocol_class(
    limits: HTTPLimits, on_reject: Callable[[str], None] = lambda reason: None
) -> type[GuardedH11Protocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` bound to ``limits`` and a fresh
    connection table (one per server)."""
    return type(
        "BoundGuardedH11Protocol",
        (GuardedH11Protocol,),
        {"limits": limits, "table": _Table(), "on_reject": staticmethod(on_reject)},
    )
