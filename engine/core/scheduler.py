"""Continuous batching with one rule for all token work.

Each step gives every running request a number of tokens under a token budget
(``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``): running requests first (a decode
is one token, an unfinished prompt gets its next chunk), then chunks of waiting prompts, skipping
prompt blocks already in the prefix cache. When blocks run out, the newest running request is
preempted: its blocks are freed and it is recomputed later (its cached prefix usually survives).
FCFS throughout; a preempted request goes back to the front of the queue.

With a KV connector (the tiered pool, or a decode worker's receiver), admission asks it for the
continuation of the device-cache hit; those tokens are loaded into blocks allocated for them while
the request waits in ``loading`` (not scheduled, holding its blocks), and it rejoins the front of
the queue when the load ends. A load that fails recomputes what did not arrive.
"""

from __future__ import annotations

import logging
from collections import deque

from engine.config import SchedulerConfig
from engine.core.request import Request, RequestStatus
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.kv_connector.base import KVConnector
from engine.kvcache.kv_cache_manager import KVCacheManager

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The admission queue is full; the caller should retry later (HTTP 429)."""


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, connector: KVConnector | None = None
    ) -> None:
        self.config = config
        self.kv = kv
        self.connector = connector
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}  # LOADING_KV: blocks held, KV arriving
        self.num_failed_loads = 0
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
        elif req.status is RequestStatus.LOADING_KV:
            del self.loading[req.request_id]
        else:
            self.waiting.remove(req)
        if self.connector is not None:
            self.connector.request_finished(req)  # before its blocks can be reused
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        del self.requests[req.request_id]

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    # -- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens
        chunk_cap = cfg.long_prefill_token_threshold or budget
        if self.loading:
            self._finish_loads()

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
            fresh = req.num_computed_tokens == 0 and req.request_id not in self.kv.block_tables
            # Prompt logprobs need every prompt position's logits: no cached prefix.
            reuse = fresh and req.prompt_logprobs is None
            hit = self.kv.find_prefix(req) if reuse else None
            cached = hit.num_tokens if hit else 0
            if reuse and self.connector is not None and not req.skip_kv_connector:
                hashes = self.kv.block_hashes(req)
                external = self.connector.lookup(req, hashes, cached)
                if external > 0:
                    if not self.kv.allocate(req, external, hit, reserve=reserve):
                        break
                    self.waiting.popleft()
                    self._start_load(req, cached, external)
                    continue
            num = min(req.num_tokens - req.num_computed_tokens - cached, budget, chunk_cap)
            if not self.kv.allocate(req, num, hit, reserve=reserve):
                break
            self.waiting.popleft()
            req.num_computed_tokens += cached
            if req.metrics.first_scheduled_time is None and fresh:
                req.metrics.num_cached_tokens = cached
                if cached:
                    req.metrics.kv_sources = {"device": cached}
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num))
            budget -= num

        out.num_batched_tokens = cfg.max_num_batched_tokens - budget
        return out

    def _start_load(self, req: Request, cached: int, external: int) -> None:
        """req holds blocks for its device hit and the external tokens; the connector fills the
        latter while req waits in ``loading``."""
        req.num_computed_tokens = cached
        req.status = RequestStatus.LOADING_KV
        if req.metrics.first_scheduled_time is None:
            req.metrics.num_cached_tokens = cached
            req.metrics.kv_sources = {"device": cached} if cached else {}
        self.loading[req.request_id] = req
        self.connector.start_load(req, self.kv.block_tables[req.request_id], cached, external)

    def _finish_loads(self) -> None:
        """Requests whose loads ended rejoin the front of the queue, oldest first."""
        back = []
        for done in self.connector.finished_loads():
            req = self.loading.pop(done.request_id, None)
            if req is None:
                continue  # finished (aborted) while loading
            if done.error is not None:
                self.num_failed_loads += 1
                req.skip_kv_connector = True
                log.warning("KV load for %s: %s; recomputing the rest", req.request_id, done.error)
            req.num_computed_tokens += done.num_tokens
            self.kv.cache_computed_blocks(req)  # loaded blocks join the device prefix cache
            if req.metrics.first_scheduled_time is None:
                req.metrics.num_cached_tokens += done.num_tokens
                for src, n in done.sources.items():
                    req.metrics.kv_sources[src] = req.metrics.kv_sources.get(src, 0) + n
            if req.num_computed_tokens == 0:
                self.kv.free(req)  # nothing arrived: admit it afresh (device hits may exist now)
            req.status = RequestStatus.WAITING
            back.append(req)
        back.sort(key=lambda r: r.metrics.arrival_time, reverse=True)
        for req in back:
            self.waiting.appendleft(req)

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
