"""What the scheduler decides for one step: the requests to run and how many tokens each, and
the requests it preempted. The step loop, the model runner and a KV connector's per-layer saver
read it; it sits apart from the scheduler so that they need not import the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens to run this step, from request.num_computed_tokens on
    # Draft tokens run after the request's last token (speculative decoding; engine/spec/):
    # the last len(spec_tokens) of num_tokens, not in request.all_token_ids.
    spec_tokens: list[int] = field(default_factory=list)

    @property
    def num_real_tokens(self) -> int:
        """The tokens of the request's own (num_tokens without the drafts)."""
        return self.num_tokens - len(self.spec_tokens)

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the request's tokens, so it yields a token
        (one per row from its last token on, with drafts)."""
        return self.request.num_computed_tokens + self.num_real_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    # Requests the scheduler ended itself this step (finished already, blocks freed): a
    # pipeline stage's prefix_exact request whose prefix was missing.
    ended: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.scheduled
