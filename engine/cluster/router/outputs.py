"""A request's outputs as the router assembles them: the workers' ``Outputs`` applied to its
choices, the client's ``RequestOutput`` built by the core's output builder, and the router's
latency and token metrics."""

from __future__ import annotations

import logging

from engine.cluster.router.request import RouterRequest
from engine.core.metrics import EngineMetrics
from engine.core.output_builder import build_output
from engine.ipc.wire import logprob_from_wire
from engine.outputs import RequestOutput

log = logging.getLogger(__name__)


PUBLIC_FINISH_REASONS = ("stop", "length")  # what a worker may end a choice with


def integrity_problem(req: RouterRequest, outputs: list[dict]) -> str | None:
    """What makes a worker's outputs not this request's continuation, before any is applied:
    a choice ended with a reason of the workers' own (``handed_over``, ``stage_done``,
    ``abort``: the request did not finish), tokens that repeat held ones differently, or a
    decode worker going on from a first token other than the one the client was sent. None
    if nothing."""
    for o in outputs:
        i = o.get("index")
        if not isinstance(i, int) or not 0 <= i < len(req.choices):
            continue
        c = req.choices[i]
        reason = o.get("finish_reason")
        if reason is not None and reason not in PUBLIC_FINISH_REASONS:
            return f"a worker ended choice {i} with {str(reason)[:40]!r}"
        first = o.get("first")
        if first is not None and c.output_token_ids and first != c.output_token_ids[0]:
            return (
                f"choice {i} went on from token {first} on the decode worker, not from the "
                f"first token {c.output_token_ids[0]} the prefill worker sent"
            )
        offset, ids = o.get("offset", 0), o.get("token_ids") or []
        held = c.output_token_ids[offset : offset + len(ids)] if offset >= 0 else []
        if held and held != ids[: len(held)]:
            return f"choice {i}'s tokens from {offset} differ from those held"
    return None


def apply_outputs(req: RouterRequest, outputs: list[dict]) -> None:
    """Append what is new in a worker's outputs (``roles.py`` sends every choice's tokens and
    text from an offset) to the request's choices; an output that repeats what is held adds
    nothing, one with a gap is dropped. Check ``integrity_problem`` first."""
    for o in outputs:
        i = o.get("index")
        if not isinstance(i, int) or not 0 <= i < len(req.choices):
            continue
        c = req.choices[i]
        skip = len(c.output_token_ids) - o["offset"]
        if skip < 0:
            log.error("request %s: a gap in choice %d's tokens", req.request_id, i)
            continue
        c.output_token_ids += o["token_ids"][skip:]
        if c.logprobs is not None and o.get("logprobs"):
            lps = [logprob_from_wire(x) for x in o["logprobs"][skip:]]
            c.logprobs += lps
            c.cumulative_logprob += sum(lp.logprob for lp in lps)
        tskip = len(c.text) - o["text_offset"]
        if tskip >= 0:
            c.text += o["text"][tskip:]
        if o["finish_reason"] and c.finish_reason is None:
            c.finish_reason, c.stop_reason = o["finish_reason"], o["stop_reason"]


def assemble(req: RouterRequest, stats: EngineMetrics, now: float) -> RequestOutput:
    """The request's output now (what is new since the last one), counted in ``stats``: time
    to first token, between tokens, end to end, tokens generated and finish reasons."""
    moved = sum(len(c.output_token_ids) - c.sent_tokens for c in req.choices)
    finished = req.finished
    m_ = req.metrics
    with stats.lock:
        if moved:
            if m_.first_token_time is None:
                m_.first_token_time = now
                stats.ttft.observe(now - m_.arrival_time)
            elif m_.last_token_time is not None:
                stats.itl.observe(now - m_.last_token_time)
            m_.last_token_time = now
            stats.generation_tokens += moved
        if finished:
            m_.finished_time = now
            stats.e2e.observe(now - m_.arrival_time)
            for c in req.choices:
                r = c.finish_reason
                stats.finished[r] = stats.finished.get(r, 0) + 1
    # The workers held back a tail that may begin a stop string: all their text is shown.
    choices = [(c, c.text, None) for c in req.choices]
    return build_output(req.request_id, req.prompt, req.ids, choices, finished, m_)
