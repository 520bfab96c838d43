"""The RPC API's messages (``engine rpc``; the server is rpc_server.py, the clients rpc_client.py),
declared on the one codec (engine/ipc/codec.py).

Wire protocol: every message is one msgpack map in one frame. A request carries ``id`` (a call
id the client picks, echoed in every reply: an integer or a string of at most 256 characters)
and ``op``:

- ``generate`` / ``stream``: ``prompt`` (text or token ids), ``params`` (SamplingParams fields),
  optional ``request_id``, ``cache_salt``, ``timeout`` (seconds; the server aborts after it),
  ``priority`` (an int, 0 by default: lower is served first under ``--scheduling-policy
  priority``; under fcfs anything else is a 400 naming it).
  ``generate`` answers one ``result``; ``stream`` answers ``chunk`` messages (deltas) and then
  one ``done`` with the usage.
- ``abort`` (``request_id``; only the caller's own requests), ``health``, ``metrics``: one
  ``ok`` reply.

A reply carries ``id`` and ``type``: ``chunk`` (``request_id``, ``outputs``), ``result``
(``request_id``, ``outputs``, ``usage``), ``done`` (``request_id``, ``usage``), ``ok`` (what the
op answers: ``aborted``; ``healthy``, ``model``, ``max_model_len``, ``num_calls``; ``metrics``),
``error``. An output is engine/ipc/wire.py's ``{"index", "text", "token_ids", "finish_reason",
"stop_reason", "logprobs"}``. Keys a reader does not know are ignored, both ways.

Any failure is one ``error`` reply, ``{"error": {"message", "type", "param", "code"}}`` with
HTTP-like codes (400 bad input, with ``param`` the field at fault; 413 too large, 429
overloaded, 503 shutting down, 408 deadline passed, 500 an internal error, whose message names
only its type). A call whose request ended without its whole answer (its outputs stopped short,
an engine's own finish reason, or a ``generate`` that the server's shutdown aborted) gets a 503
error naming why; a ``stream`` cut by the shutdown ends on a chunk with finish_reason "abort",
and one the client aborted (the ``abort`` op) gets "abort" as its answer, streamed or not.
"""

from __future__ import annotations

from dataclasses import field
from typing import Annotated

from engine.ipc import codec
from engine.ipc.codec import Len, Range

MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # the server answers larger requests with a 413
MAX_ID_CHARS = 256

CallId = int | Annotated[str, Len(0, MAX_ID_CHARS)] | None
RequestId = Annotated[str, Len(0, MAX_ID_CHARS)]


class Request(codec.Message):
    id: CallId = field(default=None, kw_only=True)  # None: the caller wants no reply matched


class Generate(Request, kind="generate"):
    prompt: str | list[int]
    params: dict | None = None  # engine/ipc/wire.py's params_from_wire checks it
    request_id: RequestId | None = None  # None or "": the server names it
    cache_salt: str | None = None
    timeout: float | None = None  # None: the server's default
    priority: Annotated[int, Range(-(2**63), 2**63 - 1)] = 0  # vLLM's: lower first


class Stream(Generate, kind="stream"):
    """A ``generate`` answered in deltas."""


class Abort(Request, kind="abort"):
    request_id: RequestId


class Health(Request, kind="health"):
    """-> ``ok``: ``healthy``, ``model``, ``max_model_len``, ``num_calls``."""


class Metrics(Request, kind="metrics"):
    """-> ``ok``: ``metrics``, the engine's counters."""


class Reply(codec.Message):
    id: CallId


class Chunk(Reply, kind="chunk"):
    request_id: str
    outputs: list[dict]  # the choices that moved, deltas


class Result(Reply, kind="result"):
    request_id: str
    outputs: list[dict]
    usage: dict  # prompt_tokens, completion_tokens, cached_tokens


class Done(Reply, kind="done"):
    request_id: str
    usage: dict


class Ok(Reply, kind="ok"):
    """The answer of abort, health or metrics: the fields it has (None ones are not sent)."""

    aborted: bool | None = None
    healthy: bool | None = None
    model: str | None = None
    max_model_len: int | None = None
    num_calls: int | None = None
    metrics: dict | None = None


class Error(Reply, kind="error"):
    error: dict  # {"message", "type", "param", "code"}


REQUESTS = codec.Codec(
    "op",
    {cls.KIND: cls for cls in (Generate, Stream, Abort, Health, Metrics)},
    max_header_bytes=MAX_MESSAGE_BYTES,
    max_frame_bytes=0,
    max_frames=1,
    ignore_unknown=True,
)
REPLIES = codec.Codec(
    "type",
    {cls.KIND: cls for cls in (Chunk, Result, Done, Ok, Error)},
    max_header_bytes=1 << 40,  # a reply is as large as the server made it (n choices' text)
    max_frame_bytes=0,
    max_frames=1,
    ignore_unknown=True,
)
OPS = tuple(REQUESTS.messages)
