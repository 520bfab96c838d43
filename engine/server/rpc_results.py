"""What the RPC clients (rpc_client.py) return: a call's result or stream deltas, and the error
an ``error`` reply raises; made from the server's replies (rpc_messages.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.server import rpc_messages as r


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Completion:
    """One choice: cumulative in a GenerateResult, a delta in a StreamDelta."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class GenerateResult:
    request_id: str
    outputs: list[Completion]
    usage: Usage

    @property
    def text(self) -> str:
        return self.outputs[0].text


@dataclass
class StreamDelta:
    request_id: str
    outputs: list[Completion]  # the choices that moved this step

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.outputs if c.index == 0)


class RPCError(RuntimeError):
    def __init__(self, message: str, code: int = 500, type: str = "", param: str | None = None):
        super().__init__(message)
        self.message, self.code, self.type, self.param = message, code, type, param

    @classmethod
    def from_reply(cls, reply: r.Error) -> RPCError:
        err = reply.error
        code = err.get("code", 500)
        kind = RPCTimeoutError if code == 408 else cls
        return kind(str(err.get("message")), code, str(err.get("type")), err.get("param"))


class RPCTimeoutError(RPCError, TimeoutError):
    pass


def completion_from_wire(d: dict) -> Completion:
    lps = d.get("logprobs")
    return Completion(
        index=d["index"],
        text=d["text"],
        token_ids=list(d["token_ids"]),
        finish_reason=d.get("finish_reason"),
        stop_reason=d.get("stop_reason"),
        logprobs=None
        if lps is None
        else [TokenLogprob(t, v, [tuple(x) for x in top]) for t, v, top in lps],
    )


def result_from_wire(reply: r.Result) -> GenerateResult:
    u = reply.usage
    return GenerateResult(
        reply.request_id,
        [completion_from_wire(c) for c in reply.outputs],
        Usage(u.get("prompt_tokens", 0), u.get("completion_tokens", 0), u.get("cached_tokens", 0)),
    )
