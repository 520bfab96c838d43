"""The one map from exceptions to HTTP statuses: typed bad input is a 400 naming its field,
anything else is a 500 that says nothing of the exception but its type, and is logged."""

from __future__ import annotations

import logging

import pytest

from engine.errors import RequestError
from engine.server.errors import APIError, to_api_error


def test_a_request_error_is_a_400_with_its_param():
    err = to_api_error(RequestError("prompt must not be empty", "prompt"))
    assert (err.status, err.param, err.message) == (400, "prompt", "prompt must not be empty")
    assert err.body()["error"]["type"] == "BadRequestError"
    chat = to_api_error(RequestError("prompt is too long", "prompt"), {"prompt": "messages"})
    assert chat.param == "messages"
    assert to_api_error(RequestError("bad", None)).param is None


@pytest.mark.parametrize(
    "exc",
    [ValueError("temperature must be a bug"), TypeError("unsupported operand"), KeyError("x")],
)
def test_any_other_exception_is_a_logged_500(exc, caplog):
    with caplog.at_level(logging.ERROR, logger="engine.server"):
        err = to_api_error(exc)
    assert err.status == 500 and err.param is None
    assert err.message == f"internal error: {type(exc).__name__}"  # nothing of what it said
    (record,) = [r for r in caplog.records if r.name == "engine.server"]
    assert record.exc_info is not None and record.exc_info[1] is exc


def test_an_api_error_passes_through():
    err = APIError(404, "no such model", "model")
    assert to_api_error(err) is err
