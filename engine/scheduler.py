"""Continuous batching with one rule for all token work.

Each step gives every running request a number of tokens under a token budget
(``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``): running requests first (a decode
is one token, an unfinished prompt gets its next chunk), then chunks of waiting prompts, skipping
prompt blocks already in the prefix cache. When blocks run out, the newest running request is
preempted: its blocks are freed and it is recomputed later (its cached prefix usually survives).
FCFS throughout; a preempted request goes back to the front of the queue.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.kvcache.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus


class QueueFullError(RuntimeError):
    """The admission queue is full; the caller should retry later (HTTP 429)."""


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens to run this step, from request.num_computed_tokens on

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the request's tokens, so it yields a token."""
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.watermark_blocks = max(1, kv.num_blocks // 100)

    # -- arrivals and departures ------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(
                f"the waiting queue is full ({self.config.max_waiting} requests); retry later"
            )
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """Finish req now (stopped, length, abort, error) and free its blocks at once."""
        if req.is_finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        del self.requests[req.request_id]

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens
        chunk_cap = cfg.long_prefill_token_threshold or budget

        # 1. Running requests, oldest first; preempt from the newest when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num = min(req.num_tokens - req.num_computed_tokens, budget, chunk_cap)
            while not self.kv.allocate(req, num):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, num))
                budget -= num
                i += 1
                continue
            break  # req itself was preempted: nothing newer is left to run

        # 2. Waiting requests, FCFS, while budget, sequence slots and blocks last.
        # Nothing new is admitted in a step that had to preempt: memory is short. Admission
        # also leaves a small watermark of free blocks for the running requests to grow into,
        # so that a request is not admitted only to be preempted (and recomputed) steps later.
        reserve = self.watermark_blocks if self.running else 0
        while self.waiting and budget > 0 and not out.preempted:
            if len(self.running) >= cfg.max_num_seqs:
                break
            req = self.waiting[0]
            hit = self.kv.find_prefix(req) if req.num_computed_tokens == 0 else None
            cached = hit.num_tokens if hit else 0
            num = min(req.num_tokens - req.num_computed_tokens - cached, budget, chunk_cap)
            if not self.kv.allocate(req, num, hit, reserve=reserve):
                break
            self.waiting.popleft()
            req.num_computed_tokens += cached
            if req.metrics.first_scheduled_time is None:
                req.metrics.num_cached_tokens = cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num))
            budget -= num

        out.num_batched_tokens = cfg.max_num_batched_tokens - budget
        return out

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance computed counts after the forward ran; name newly full blocks."""
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_tokens
            self.kv.cache_computed_blocks(s.request)
