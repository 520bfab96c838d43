"""The output side of the engine loop: what a step's forward produced becomes each request's
tokens, stop checks, metrics and ``RequestOutput``s.

A user request (``Parent``) fans out into one ``Request`` per choice (n > 1: ``rid#i``); its
output is built from all of them and it is gone once all ended. ``StepResult`` is what a step's
forward hands over: the sampled tokens of the rows that sample (engine/core/sample_step.py), or,
on a pipeline stage short of the last, the requests whose prompt ran (engine/core/stage_step.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.core.metrics import EngineMetrics
from engine.core.output_builder import build_output
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import ScheduledRequest
from engine.core.stop_conditions import StopResult, check_stop, safe_text_len
from engine.model.tokenizer import Tokenizer
from engine.outputs import RequestOutput, TokenLogprob

logger = logging.getLogger("engine")

HANDED_OVER = "handed_over"  # finish reason of a choice that goes on in another engine
STAGE_DONE = "stage_done"  # finish reason on a pipeline stage short of the last: prompt ran
# A choice that failed: finish reason "error", its stop reason says why. The servers answer 503.
ERROR = "error"
GRAMMAR_REFUSED = "grammar_refused"  # its grammar refused a token sampled without it


class FirstToken(NamedTuple):
    """A choice's first token, sampled by another engine that prefilled the prompt (a prefill
    worker), and the state that continues it here exactly as if this engine had sampled it."""

    token: int
    logprob: TokenLogprob | None = None
    sent_text_len: int = 0  # characters of its text the client has seen already
    generator_state: bytes | None = None  # the seeded generator's state after sampling it


@dataclass
class Parent:
    """A user request; n > 1 fans out into n child sequences that share the prompt's KV blocks."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]


@dataclass(frozen=True)
class StepResult:
    """What one step's forward produced. ``tokens`` (and ``logprobs``, one per row, None where
    not asked) are the sampled tokens of ``requests``; None on a pipeline stage short of the
    last, whose ``requests`` are those whose prompt ran (they end STAGE_DONE; the stage handed
    its KV on layer by layer, so it saves no whole blocks). ``forward_done`` and
    ``sampled_done`` are the step timer's clocks."""

    requests: list[Request]
    tokens: list[int] | None
    logprobs: list[TokenLogprob | None] | None
    forward_done: float
    sampled_done: float
    # Speculative decoding: (request, drafts proposed, drafts kept) of each sequence that
    # verified drafts; its tokens in ``tokens`` are the kept drafts and one more, in order.
    drafts: list[tuple[Request, int, int]] = field(default_factory=list)


class OutputProcessor:
    """The engine's requests in flight (``parents``, by request id) and the outputs made between
    steps (``pending``, handed out with the next step's)."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        eos_token_ids: tuple[int, ...],
        metrics: EngineMetrics,
    ) -> None:
        self.scheduler, self.tokenizer, self.metrics = scheduler, tokenizer, metrics
        self.eos_token_ids = eos_token_ids
        self.parents: dict[str, Parent] = {}
        self.pending: list[RequestOutput] = []
        self._token_texts: dict[int, str] = {}

    def take_pending(self) -> list[RequestOutput]:
        outputs, self.pending = self.pending, []
        return outputs

    def note_scheduled(self, scheduled: Sequence[ScheduledRequest], now: float) -> None:
        """The first time a request is scheduled: its queue time."""
        for s in scheduled:
            m = s.request.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
                with self.metrics.lock:
                    self.metrics.queue_time.observe(now - m.arrival_time)

    def ended(self, reqs: Sequence[Request]) -> list[RequestOutput]:
        """Requests the scheduler ended itself (a stage's missing exact prefix)."""
        for req in reqs:
            self.count_finished(req)
        return self.outputs_of(reqs)

    def deliver(self, ran: StepResult, now: float) -> list[RequestOutput]:
        """A step's tokens appended (or its stage rows ended), then the outputs that moved."""
        if ran.tokens is None:
            for req in ran.requests:
                self.finish(req, STAGE_DONE)
        else:
            for req, token, lp in zip(ran.requests, ran.tokens, ran.logprobs):
                if not req.is_finished:  # (a stop among a step's kept drafts ends the rest)
                    self.append(req, token, lp, now)
        return self.outputs_of(ran.requests)

    def end(self, parent: Parent) -> None:
        """Every choice of ``parent`` ended: its final output waits for the next step."""
        self.pending.append(self.make_output(parent, final=True))
        del self.parents[parent.request_id]

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        self.scheduler.finish(req, reason, stop_reason)
        self.count_finished(req)

    def append(self, req: Request, token: int, lp: TokenLogprob | None, now: float) -> None:
        """One token of ``req`` (sampled here or, for a prefilled request's first, elsewhere):
        metrics, the grammar, logprobs, text and the stop checks."""
        m = req.metrics
        with self.metrics.lock:
            if m.first_token_time is None:
                m.first_token_time = now
                self.metrics.ttft.observe(now - m.arrival_time)
            else:
                self.metrics.itl.observe(now - m.last_token_time)
            self.metrics.generation_tokens += 1
        m.last_token_time = now
        if req.grammar is not None and not req.grammar.accept(token):
            # Only a token sampled elsewhere without the constraint gets here.
            logger.error("%s: token %d is not allowed by its grammar", req.request_id, token)
            self.finish(req, ERROR, GRAMMAR_REFUSED)
            return
        req.append_token(token)
        if lp is not None and req.logprobs is not None:
            req.logprobs.append(lp)
            req.cumulative_logprob += lp.logprob
        delta = req.detokenizer.add_tokens([token])
        stop = check_stop(
            req.params,
            token,
            req.num_output_tokens,
            self.eos_token_ids,
            req.detokenizer.text,
            len(delta),
        )
        if stop.truncate_to is not None:
            req.text_limit = stop.truncate_to
        elif stop.finished:
            req.detokenizer.flush()  # an incomplete character at the very end
        if not stop.finished and req.grammar is not None and req.grammar.terminated:
            stop = StopResult(True, "stop", None, None)  # the grammar ended (ignore_eos)
        if stop.finished:
            self.finish(req, stop.finish_reason, stop.stop_reason)

    def count_finished(self, req: Request) -> None:
        now = time.monotonic()
        req.metrics.finished_time = now
        with self.metrics.lock:
            self.metrics.finished[req.finish_reason] = (
                self.metrics.finished.get(req.finish_reason, 0) + 1
            )
            self.metrics.e2e.observe(now - req.metrics.arrival_time)

    def outputs_of(self, moved: Sequence[Request]) -> list[RequestOutput]:
        """The outputs of the requests whose choices in ``moved`` moved (or ended), each once;
        a request whose choices all ended gives its final output and is gone."""
        parents: dict[str, Parent] = {}
        for req in moved:
            parent = self.parents.get(parent_id(req))
            if parent is not None:
                parents[parent.request_id] = parent
        outputs = []
        for parent in parents.values():
            done = all(c.is_finished for c in parent.children)
            outputs.append(self.make_output(parent, final=done))
            if done:
                del self.parents[parent.request_id]
        return outputs

    def make_output(self, parent: Parent, final: bool) -> RequestOutput:
        choices = []
        for req in parent.children:
            text = req.detokenizer.text[: req.text_limit]
            # Hold back a tail that might be the start of a stop string until we know.
            visible = len(text) if req.is_finished else safe_text_len(text, req.params.stop)
            choices.append((req, text, visible))
        first = parent.children[0]
        return build_output(
            parent.request_id,
            parent.prompt,
            parent.prompt_token_ids,
            choices,
            final,
            first.metrics,
            first.prompt_logprobs,
        )

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (prompt logprobs' alternatives)."""
        text = self._token_texts.get(token_id)  # bounded by the vocabulary
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text


def parent_id(req: Request) -> str:
    rid = req.request_id
    return rid.rsplit("#", 1)[0] if req.params.n > 1 else rid
