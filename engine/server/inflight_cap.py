"""A cap on the generation requests one client may have in flight, answered with OpenAI's 429.

Without it one client can fill the whole admission queue (``--max-pending``): a flood of short
requests from one address put every other client's request behind up to a thousand of its own
(first come, first served), and the engine's steps grew to the largest batch, so a
well-behaved client's time to first token went up eightfold. With a per-client cap the flood
holds at most ``cap`` places, everyone else keeps theirs, and the steps stay small.

A client is its peer address. Not the API key: the server has one key, which every client
shares, so it names nobody; and not a header or body field (``user``): an attacker would send a
new value with every request. Behind a reverse proxy every client has the proxy's address:
raise the cap there (or turn it off with 0).

A pure ASGI middleware, in front of the FastAPI app: a request over the cap costs a dictionary
lookup and a pre-encoded response, not routing, body parsing and validation. A request's place
is held until the app returns, which for a streamed response is when its last event is sent.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from engine.server.errors import RETRY_AFTER_S, error_body

GENERATION_PATHS = frozenset(("/v1/completions", "/v1/chat/completions", "/v1/responses"))


class ClientCap:
    def __init__(self, app, cap: int, on_reject: Callable[[str], None]) -> None:
        if cap < 1:
            raise ValueError(f"the per-client cap must be >= 1, got {cap}")
        self.app = app
        self.cap = cap
        self.on_reject = on_reject
        self.in_flight: dict[str, int] = {}  # only clients with requests in flight
        message = (
            f"this client already has {cap} requests in flight, the most one client may have "
            "(--max-pending-per-client); retry later"
        )
        self._body = json.dumps(error_body(429, message)).encode()
        self._headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(self._body)).encode()),
            (b"retry-after", str(RETRY_AFTER_S).encode()),
        ]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        client = scope["client"][0] if scope.get("client") else ""
        held = self.in_flight.get(client, 0)
        if held >= self.cap:
            self.on_reject("client_cap")
            await send({"type": "http.response.start", "status": 429, "headers": self._headers})
            await send({"type": "http.response.body", "body": self._body})
            return
        self.in_flight[client] = held + 1
        try:
            await self.app(scope, receive, send)
        finally:
            left = self.in_flight[client] - 1
            if left:
                self.in_flight[client] = left
            else:
                del self.in_flight[client]
