"""Continuous batching with one rule for all token work.

Each step gives every running request a number of tokens under a token budget
(``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``): running requests first (a decode
is one token, an unfinished prompt gets its next chunk), then chunks of waiting prompts, skipping
prompt blocks already in the prefix cache. When blocks run out, the newest running request is
preempted: its blocks are freed and it is recomputed later (its cached prefix usually survives).

The policy (SchedulerConfig.policy, vLLM's ``--scheduling-policy``): under ``fcfs`` the queue is
in arrival order, a preempted request goes back to its front, running requests are served in the
order they were admitted and the newest is preempted first. Under ``priority`` the queue is kept
in (priority, arrival) order (a lower value first; a preempted request goes back to its place
by that key), running requests are served in that order too (their prompt chunks take the
budget first) and the last of them, the largest (priority, arrival), is preempted first. As in
vLLM, nothing running is preempted to admit a waiting request: a high-priority request waits
for a sequence slot or blocks to free up, but ahead of every lower-priority one.

With a KV connector (the tiered pool, or a decode worker's receiver), admission asks it for the
continuation of the device-cache hit; those tokens are loaded into blocks allocated for them while
the request waits in ``loading`` (not scheduled, holding its blocks), and it rejoins the front of
the queue when the load ends. A load that fails recomputes what did not arrive.

Pipeline stages (engine/core/stage_io.py): a request runs no further than its ``ready_tokens``
(the prompt tokens whose inputs are here); one with nothing ready is passed over, running or
waiting, without holding up the others. ``prefill_only`` (every stage): nothing past the prompt is
scheduled. ``prefix_tokens`` caps the device prefix hit; with ``prefix_exact`` a fresh admission
(also a re-admission after preemption) must hit exactly that many tokens, or the request ends at
once ("abort", stop reason PREFIX_MISSING) and is listed in the step's ``ended``.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque

from engine.config import SchedulerConfig
from engine.core.request import Request, RequestStatus
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.kv_connector.base import KVConnector
from engine.kvcache.kv_cache_manager import KVCacheManager

log = logging.getLogger(__name__)


PREFIX_MISSING = "prefix_missing"  # stop reason: prefix_exact found fewer cached tokens


class QueueFullError(RuntimeError):
    """The admission queue is full; the caller should retry later (HTTP 429)."""


def queue_key(req: Request) -> tuple[int, float]:
    """The priority policy's order: a lower priority value first, then the earlier arrival."""
    return (req.priority, req.metrics.arrival_time)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        connector: KVConnector | None = None,
        prefill_only: bool = False,
    ) -> None:
        if config.max_num_batched_tokens is None:
            raise ValueError(
                "max_num_batched_tokens: the Scheduler takes a number; "
                "SchedulerConfig.for_device fills in the device's default"
            )
        self.config = config
        self.by_priority = config.policy == "priority"
        self.prefill_only = prefill_only
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
        self._enqueue(req)

    def _enqueue(self, req: Request, front: bool = False) -> None:
        """Into the waiting queue: fcfs at its back (``front``: its front, a preempted or loaded
        request); priority at its place by queue_key, after its equals."""
        if not self.by_priority:
            if front:
                self.waiting.appendleft(req)
            else:
                self.waiting.append(req)
            return
        key = queue_key(req)
        self.waiting.insert(bisect.bisect_right(self.waiting, key, key=queue_key), req)

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

        # 1. Running requests, oldest first; preempt from the newest when blocks run out (under
        # priority: by queue_key, the victim the largest; the victim is never one served already).
        if self.by_priority:
            self.running.sort(key=queue_key)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num = min(self._limit(req) - req.num_computed_tokens, budget, chunk_cap)
            if num <= 0:
                i += 1  # nothing ready (a pipeline stage): the others still run
                continue
            drafts: list[int] = []
            if num == 1 and req.spec_token_ids:  # a decode: its drafts run after its token
                drafts = req.spec_token_ids[: budget - 1]
                num += len(drafts)
            while not self.kv.allocate(req, num):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, num, drafts))
                budget -= num
                i += 1
                continue
            break  # req itself was preempted: nothing newer is left to run

        # 2. Waiting requests in queue order, while budget, sequence slots and blocks last.
        # Nothing new is admitted in a step that had to preempt: memory is short. Admission
        # also leaves a small watermark of free blocks for the running requests to grow into,
        # so that a request is not admitted only to be preempted (and recomputed) steps later.
        reserve = self.watermark_blocks if self.running else 0
        idx = 0  # the queue's first request that is not passed over (nothing ready)
        while idx < len(self.waiting) and budget > 0 and not out.preempted:
            if len(self.running) >= cfg.max_num_seqs:
                break
            req = self.waiting[idx]
            fresh = req.num_computed_tokens == 0 and req.request_id not in self.kv.block_tables
            exact = fresh and req.prefix_exact
            if not exact and self._limit(req) <= req.num_computed_tokens:
                idx += 1  # nothing ready: it stays waiting, the others may go
                continue
            # Prompt logprobs need every prompt position's logits: no cached prefix.
            reuse = fresh and req.prompt_logprobs is None
            hit = self.kv.find_prefix(req, req.prefix_tokens) if reuse else None
            cached = hit.num_tokens if hit else 0
            if exact and cached != req.prefix_tokens:  # told at once, ready or not
                self.finish(req, "abort", PREFIX_MISSING)  # nothing allocated yet
                out.ended.append(req)
                continue
            if reuse and self.connector is not None and not req.skip_kv_connector:
                hashes = self.kv.block_hashes(req)
                external = self.connector.lookup(req, hashes, cached)
                if external > 0:
                    if not self.kv.allocate(req, external, hit, reserve=reserve):
                        break
                    del self.waiting[idx]
                    self._start_load(req, cached, external)
                    continue
            num = min(self._limit(req) - req.num_computed_tokens - cached, budget, chunk_cap)
            if num <= 0:
                idx += 1  # nothing ready past its prefix hit: it stays waiting
                continue
            if not self.kv.allocate(req, num, hit, reserve=reserve):
                break
            del self.waiting[idx]
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

    def _limit(self, req: Request) -> int:
        """The tokens of req that may have run by the end of this step: all of them, or only
        the prompt (``prefill_only``), and no more than its ``ready_tokens``."""
        end = req.num_prompt_tokens if self.prefill_only else req.num_tokens
        return end if req.ready_tokens is None else min(end, req.ready_tokens)

    def _start_load(self, req: Request, cached: int, external: int) -> None:
        """req holds blocks for its device hit and the external tokens; the connector fills the
        latter while req waits in ``loading``."""
        req.num_computed_tokens = cached
        req.status = RequestStatus.LOADING_KV
        if req.metrics.first_scheduled_time is None:
            req.metrics.num_cached_tokens = cached
            req.metrics.kv_sources = {"device": cached} if cached else {}
        req.load_started = time.monotonic()
        self.loading[req.request_id] = req
        self.connector.start_load(req, self.kv.block_tables[req.request_id], cached, external)

    def _finish_loads(self) -> None:
        """Requests whose loads ended rejoin the front of the queue, oldest first (under
        priority: their places by queue_key)."""
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
            req.metrics.kv_load_time += time.monotonic() - req.load_started  # _start_load's
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
            self._enqueue(req, front=True)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        req.spec_token_ids = []
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req, front=True)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance computed counts after the forward ran; name newly full blocks. Drafts are
        not counted: the step commits those kept once they are output (commit_drafts)."""
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_real_tokens
            self.kv.cache_computed_blocks(s.request)

    def commit_drafts(self, req: Request) -> int:
        """After a step that verified drafts of the running ``req`` and appended what it kept:
        the kept drafts' KV is computed (everything but the new last token), their full blocks
        are named, and blocks past the next token's are freed (the rejected drafts' rows in them
        are never read: a later step writes those positions again). Returns the tokens
        committed."""
        kept = req.num_tokens - 1 - req.num_computed_tokens
        req.num_computed_tokens += kept
        self.kv.cache_computed_blocks(req)
        self.kv.trim(req, req.num_tokens)
        return kept
