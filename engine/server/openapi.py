"""The served OpenAPI document: request bodies and every status and content type each route
returns, so that schema-driven tools (client generators, schemathesis) see the real API.

The routes read and validate their bodies themselves (a size limit first, then the strict
pydantic models of openai_protocol.py), so FastAPI cannot infer the bodies; they are declared
here from the same models.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    """OpenAI's error shape; every non-2xx answer has it."""

    error: ErrorDetail


_DESCRIPTIONS = {
    400: "Invalid request: the message and param name the field and its limit",
    401: "Missing or wrong API key",
    404: "Unknown model",
    408: "The request did not arrive within its read deadline, or (a cluster) did not finish "
    "within its deadline",
    413: "Request body too large",
    429: "Overloaded: retry after Retry-After seconds",
    503: "Shutting down, or the engine is not running",
}
# Any route may meet these: the read deadlines and connection caps (http_limits.py).
_ALWAYS = (408, 429)


def errors(*codes: int, auth: bool = False) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for these error statuses (plus the ones any route may return)."""
    wanted = sorted({*codes, *_ALWAYS, *((401,) if auth else ())})
    return {c: {"model": ErrorResponse, "description": _DESCRIPTIONS[c]} for c in wanted}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra=`` for a route that reads ``model`` as its JSON body."""
    schema = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install(app: FastAPI, body_models: list[type[BaseModel]]) -> None:
    """Make ``app.openapi()`` include the body models (and the models they use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in body_models:
                schema = model.model_json_schema(ref_template=REF)
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
