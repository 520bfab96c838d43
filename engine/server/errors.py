"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, and the one map
from engine exceptions to HTTP statuses that both the HTTP and the RPC server use.

Bad input is a 400 only when it says so: a ``RequestError`` (engine/errors.py) naming its field,
or an ``APIError`` raised with a status. Any other exception, a ValueError or TypeError from a
bug included, is a 500 with a generic message, and its traceback goes to the log."""

from __future__ import annotations

import logging

from engine.async_llm import EngineDeadError, EngineShuttingDownError
from engine.core.scheduler import QueueFullError
from engine.errors import RequestError
from engine.structured.compiler import GrammarBusyError

logger = logging.getLogger("engine.server")

# The type names vLLM's OpenAI server uses (and the openai client maps by status anyway).
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "TimeoutError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

RETRY_AFTER_S = 1  # what a 429 tells the client to wait


class APIError(Exception):
    """An error with an HTTP status, raised anywhere in a request's handling."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}
        self.reason: str | None = None  # a 429's or 503's cause for request_rejected_total

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "APIError"),
            "param": param,
            "code": status,
        }
    }


def to_api_error(exc: BaseException, aliases: dict[str, str] | None = None) -> APIError:
    """Map an exception from the engine (or our own code) to an APIError. ``aliases`` renames
    a RequestError's field to the request's own (prompt -> messages for chat)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestError):
        param = exc.param if exc.param is None else (aliases or {}).get(exc.param, exc.param)
        return APIError(400, exc.message, param)
    if isinstance(exc, QueueFullError):
        err = APIError(429, str(exc), headers={"Retry-After": str(RETRY_AFTER_S)})
        err.reason = getattr(exc, "reason", None)  # the cluster's admission says why
        return err
    if isinstance(exc, EngineShuttingDownError):
        err = APIError(503, str(exc) or "the server is shutting down")
        err.reason = "shutting_down"
        return err
    if isinstance(exc, GrammarBusyError):  # too many constraints compiling: retry later
        err = APIError(503, str(exc), "structured_outputs", {"Retry-After": str(RETRY_AFTER_S)})
        err.reason = "grammar_busy"
        return err
    if isinstance(exc, EngineDeadError):
        err = APIError(503, str(exc))
        err.reason = "unavailable"  # the engine died, or no worker of the cluster can serve
        return err
    if isinstance(exc, TimeoutError):
        return APIError(408, str(exc) or "the request's deadline passed")
    logger.exception("internal error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}")
