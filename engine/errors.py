"""The error a request's bad input raises, wherever it is checked: the sampling parameters, the
prompt against the model's limits, a structured-output constraint, the OpenAI and RPC request
bodies. It names the field, so the HTTP and RPC servers answer 400 with that ``param`` without
reading the message; any other exception reaching them is an internal error (500).

A leaf: it imports nothing of the engine, so every layer can raise it.
"""

from __future__ import annotations


class RequestError(ValueError):
    """A request's input is invalid: ``param`` names the field ("max_tokens", "prompt",
    "structured_outputs", ...; None when no one field is to blame), ``message`` says what is
    wrong and the limit. A ValueError, so callers of the embedded API that catch ValueError
    keep working; ``str(exc)`` is the message."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def __reduce__(self):  # pickled whole (the default would lose ``param``)
        return type(self), (self.message, self.param)
