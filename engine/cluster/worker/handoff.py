"""Handing a request from the prefill engine to the decode engine after its first token.

The prefill worker runs the request with its real sampling parameters until every choice has
sampled its first token, then ``capture`` records per choice what the decode side needs to go on
exactly as a colocated engine would: the token and its logprobs, the stop state (finish reason,
stop reason, the text cut), the stream cursors (text already handed to the client), and the
seeded generator's state (the position in its random stream). The decode worker's ``admit``
re-creates the request in its engine with ``LLMEngine.add_prefilled``, which replays that first
token through the engine's own append path (detokenizer, stop checks, logprobs) and restores the
cursors and the generator. The prefill side ends its choices with ``LLMEngine.hand_over``
(finish reason ``handed_over``, not an abort). Only those public engine methods are used.
"""

from __future__ import annotations

from typing import NamedTuple

from engine.core.llm_engine import FirstToken, LLMEngine
from engine.core.request import Request
from engine.ipc.wire import logprob_from_wire, logprob_to_wire
from engine.sampling_params import SamplingParams


class Captured(NamedTuple):
    first: dict  # the KVDone "firsts" entry
    generator_state: bytes | None


def capture(index: int, req: Request) -> Captured:
    """req has sampled its first token (the engine's step already streamed it, so its cursors
    point past it)."""
    text = req.detokenizer.text[: req.text_limit]
    lp = req.logprobs[0] if req.logprobs else None
    first = {
        "index": index,
        "token": req.output_token_ids[0],
        "logprob": logprob_to_wire(lp),
        "finish_reason": req.finish_reason,
        "stop_reason": req.stop_reason,
        "text": text[: req.sent_text_len],
        "sent_text_len": req.sent_text_len,
        "generator": req.generator is not None,
    }
    state = None
    if req.generator is not None:
        state = bytes(req.generator.get_state().numpy().tobytes())
    return Captured(first, state)


def first_output(first: dict) -> dict:
    """The router's ``Outputs`` entry for a first token."""
    return {
        "index": first["index"],
        "offset": 0,
        "token_ids": [first["token"]],
        "logprobs": None if first["logprob"] is None else [first["logprob"]],
        "text_offset": 0,
        "text": first["text"],
        "finish_reason": first["finish_reason"],
        "stop_reason": first["stop_reason"],
    }


def admit(
    engine: LLMEngine,
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    firsts: list[dict] | None,
    states: list[bytes],
    priority: int = 0,
) -> list[str]:
    """Add the request to the decode engine (with ``priority``); with ``firsts``, every choice
    continues from its first token. Returns the engine request ids that still generate (for the
    KV receiver)."""
    if firsts is None:
        engine.add_request(prompt_token_ids, params, request_id=request_id, priority=priority)
        return [r.request_id for r in engine.requests_of(request_id)]
    states_iter = iter(states)
    tokens = [
        FirstToken(
            first["token"],
            logprob_from_wire(first["logprob"]),
            first["sent_text_len"],
            next(states_iter) if first.get("generator") else None,
        )
        for first in sorted(firsts, key=lambda f: f["index"])
    ]
    return engine.add_prefilled(prompt_token_ids, params, request_id, tokens, priority)
