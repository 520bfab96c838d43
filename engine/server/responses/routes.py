"""The HTTP routes of the Responses API, added to the app http_server.py builds; ``create`` is the
app's generation handler (admission, body limits, disconnects and errors as on the chat route)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request
from starlette.responses import Response

from engine.server import openapi
from engine.server.responses.protocol import ResponsesRequest
from engine.server.responses.serving import ResponsesServing


def install(
    app: FastAPI,
    serving: ResponsesServing,
    create: Callable[[Request], Awaitable[Response]],
    generation_docs: dict,
    auth: bool,
) -> None:
    @app.post("/v1/responses", openapi_extra=openapi.json_body(ResponsesRequest), **generation_docs)
    async def create_response(request: Request) -> Response:
        return await create(request)

    @app.get("/v1/responses/{response_id}", responses=openapi.errors(404, auth=auth))
    async def get_response(response_id: str) -> dict:
        return serving.get(response_id)

    @app.delete("/v1/responses/{response_id}", responses=openapi.errors(404, auth=auth))
    async def delete_response(response_id: str) -> dict:
        return serving.delete(response_id)
