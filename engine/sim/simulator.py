"""A discrete-event simulator of a serving cluster, driving the real Conductor.

Disaggregated (``prefill`` + ``decode`` instances, placed by
``engine.cluster.conductor.conductor``) or colocated (``colocated`` instances that each prefill
and decode, vLLM-0.5 style: a waiting prefill runs before the next decode step, stalling the
running batch; requests go to the instance with the fewest outstanding). Times come from a
``CostModel``; prefix caches are the block store's real eviction policies
(``engine.kvstore.eviction``) with a capacity in blocks, and the Conductor learns what each
instance holds from the same ``stored``/``removed`` events the real instances publish. The
instances' state (caches, queues, batches) is in engine/sim/instances.py; this module is the event
model that drives it, and the results.

What a prefill instance does: one request at a time, FIFO. It first copies the blocks the
decision says to copy (those its source still holds), then prefills the tokens its cache lacks;
at the end its blocks enter its cache (evicting by the policy) and the first token is out (TTFT).
The KV reaches the decode instance one streamed layer later. A decode instance admits a request
if its KV (prompt + output, reserved whole) fits and its batch has room; with a finite TBT SLO
it refuses one that does not fit or would push its step time past the SLO (the paper's
decode-stage check, which wastes the prefill); with an infinite one the request waits.

Token intervals: a request's first interval runs from its first token to the end of its first
decode step, then one per step. Its TBT is the mean of its longest 10% intervals (FAST'25 §5).
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass

import numpy as np

from engine.cluster.conductor.conductor import Conductor, ConductorConfig
from engine.cluster.conductor.cost_model import CostModel, get_cost_model
from engine.cluster.conductor.pipeline import PipelineShape, run_pipeline, stage_plan
from engine.kvstore.eviction import POLICIES as EVICTIONS
from engine.sim.instances import SimCache, SimDecode, SimPrefill, SimRequest
from engine.sim.trace import TraceRequest

# FAST'25 Fig. 10: 3M tokens of DRAM cache per prefill node = 5,859 blocks of 512 tokens.
DEFAULT_CACHE_BLOCKS = 3_000_000 // 512


@dataclass(frozen=True)
class SimConfig:
    prefill: int = 8  # single prefill instances
    decode: int = 8
    # Prefill groups of ``stages`` instances each (chunked pipeline parallelism, beside the
    # single ones): a prompt whose uncached part exceeds ``chunk_tokens`` is cut into chunks
    # that flow through the stages (engine/cluster/conductor/pipeline.py).
    prefill_groups: int = 0
    stages: int = 2
    chunk_tokens: int = 4096
    colocated: int = 0  # > 0: that many colocated instances instead of prefill + decode
    policy: str = "kvcentric"
    rejection: str = "predicted"
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1
    balancing_threshold: float = 1.5
    seed: int = 0
    cost_model: str = "paper"
    cache_blocks: int = DEFAULT_CACHE_BLOCKS  # per prefill instance (colocated: HBM, see below)
    pool_blocks: int = 0  # a global pool every prefill writes to (0: none)
    eviction: str = "lru"
    timeline_s: float = 0.0  # sample loads every so many seconds (0: off)
    # The Conductor is told each request's output length (an oracle: how much a perfect
    # output-length prediction would help predicted rejection).
    oracle_output: bool = False

    def __post_init__(self) -> None:
        if self.colocated < 0:
            raise ValueError(f"colocated must be >= 0, got {self.colocated}")
        if self.prefill < 0 or self.prefill_groups < 0:
            raise ValueError(
                f"prefill and prefill_groups must be >= 0, got {self.prefill} and "
                f"{self.prefill_groups}"
            )
        if not self.colocated and (self.prefill + self.prefill_groups < 1 or self.decode < 1):
            raise ValueError(
                f"need a prefill instance or group and a decode instance, got prefill="
                f"{self.prefill}, prefill_groups={self.prefill_groups}, decode={self.decode}"
            )
        if self.prefill_groups and self.stages < 2:
            raise ValueError(f"stages must be >= 2 in a prefill group, got {self.stages}")
        PipelineShape(self.stages, self.chunk_tokens)  # validates chunk_tokens
        if self.cache_blocks < 0 or self.pool_blocks < 0:
            raise ValueError("cache_blocks and pool_blocks must be >= 0")
        if self.eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {EVICTIONS}, got {self.eviction!r}")
        if self.timeline_s < 0:
            raise ValueError(f"timeline_s must be >= 0, got {self.timeline_s}")
        get_cost_model(self.cost_model)
        self.conductor_config()  # validates policy, rejection, SLOs, threshold

    def conductor_config(self) -> ConductorConfig:
        return ConductorConfig(
            policy=self.policy,
            rejection=self.rejection,
            ttft_slo_s=self.ttft_slo_s,
            tbt_slo_s=self.tbt_slo_s,
            balancing_threshold=self.balancing_threshold,
            block_tokens=get_cost_model(self.cost_model).block_tokens,
            seed=self.seed,
        )


ARRIVE, PREFILL_END, KV_ARRIVE, STEP_END, SAMPLE, COLOC_PREFILL_END, PREFILL_NEXT = range(7)


class Simulator:
    def __init__(self, config: SimConfig, requests: list[TraceRequest]) -> None:
        self.cfg = config
        self.cost: CostModel = get_cost_model(config.cost_model)
        self.bt = self.cost.block_tokens
        self.requests = requests
        self.conductor = Conductor(config.conductor_config(), prior=self.cost)
        self._events: list = []
        self._seq = 0
        self.now = 0.0
        self.prefills: dict[str, SimPrefill] = {}
        self.decodes: dict[str, SimDecode] = {}
        self.pool: SimCache | None = None
        self.coloc: list[SimDecode] = []
        cap = self.cost.decode_kv_capacity_tokens
        if config.colocated:
            # vLLM keeps its prefix cache in the HBM the running requests leave free: the cache
            # gets the KV capacity in blocks, the admission check the same tokens.
            for i in range(config.colocated):
                d = SimDecode(f"c{i}", cap, self.cost.max_batch)
                d.cache = SimCache(cap // self.bt, config.eviction)
                self.coloc.append(d)
        else:
            for i in range(config.prefill):
                name = f"p{i}"
                self.prefills[name] = SimPrefill(
                    name, SimCache(config.cache_blocks, config.eviction)
                )
                self.conductor.add_instance(name, "prefill")
            shape = PipelineShape(config.stages, config.chunk_tokens)
            for i in range(config.prefill_groups):
                name = f"g{i}"
                cache = SimCache(config.cache_blocks, config.eviction)
                self.prefills[name] = SimPrefill(
                    name, cache, shape=shape, free=[0.0] * shape.stages
                )
                self.conductor.add_instance(name, "prefill", shape=shape)
            for i in range(config.decode):
                name = f"d{i}"
                self.decodes[name] = SimDecode(name, cap, self.cost.max_batch)
                self.conductor.add_instance(name, "decode", kv_capacity_tokens=cap)
            if config.pool_blocks:
                self.pool = SimCache(config.pool_blocks, config.eviction)
                self.conductor.add_instance("pool", "pool")
        # outcomes
        self.outcome: dict[str, str] = {}  # rid -> "completed" | "rejected_arrival" | ...
        self.ttft: dict[str, float] = {}
        self.tbt: dict[str, float] = {}  # FAST'25 metric: mean of the longest 10% intervals
        self.intervals: dict[str, np.ndarray] = {}  # rid -> its token intervals
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.copied_blocks = 0
        self.wasted_prefill_s = 0.0
        self.timeline: list[tuple] = []  # (t, prefill load, decode load, accepted, rejected)
        self._window = [0, 0]
        self.decode_steps = 0

    # -- event queue -----------------------------------------------------------------------------

    def _at(self, t: float, kind: int, obj) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, obj))

    def run(self) -> dict:
        wall = time.perf_counter()
        for tr in self.requests:
            self._at(tr.arrival_s, ARRIVE, SimRequest(tr))
        if self.cfg.timeline_s and not self.cfg.colocated:
            self._at(0.0, SAMPLE, None)
        handlers = {
            ARRIVE: self._arrive,
            PREFILL_END: self._prefill_end,
            KV_ARRIVE: self._kv_arrive,
            STEP_END: self._step_end,
            SAMPLE: self._sample,
            COLOC_PREFILL_END: self._coloc_prefill_end,
            PREFILL_NEXT: self._prefill_next,
        }
        events = self._events
        pending = len(self.requests)
        while events:
            t, _, kind, obj = heapq.heappop(events)
            self.now = t
            handlers[kind](obj)
            if kind == SAMPLE and len(self.outcome) >= pending:
                break
        return self.summary(time.perf_counter() - wall)

    def _finish(self, req: SimRequest, outcome: str) -> None:
        if req.rid in self.outcome:
            raise AssertionError(f"request {req.rid} ended twice")
        self.outcome[req.rid] = outcome
        req.done = True

    # -- disaggregated: arrival and prefill ------------------------------------------------------

    def _arrive(self, req: SimRequest) -> None:
        if self.cfg.colocated:
            return self._coloc_arrive(req)
        tr = req.tr
        hint = tr.output_len if self.cfg.oracle_output else None
        d = self.conductor.decide(req.rid, tr.hash_ids, tr.input_len, self.now, hint)
        if not d.accepted:
            self._window[1] += 1
            return self._finish(req, "rejected_arrival")
        self._window[0] += 1
        req.decision = d
        p = self.prefills[d.prefill]
        p.queue.append(req)
        if p.job is None:
            self._start_prefill(p)

    def _holder(self, name: str) -> SimCache:
        return self.pool if name == "pool" else self.prefills[name].cache

    def _start_prefill(self, p: SimPrefill) -> None:
        req = p.queue.popleft()
        p.job = req
        keys = req.tr.hash_ids
        copy_s = 0.0
        for c in req.decision.copies:
            src = self._holder(c.src)
            have = p.cache.match(keys)
            upto = min(req.decision.prefix_blocks, src.match(keys))
            if upto > have:
                src.touch(keys[have:upto])
                self._store(p, keys[have:upto], pinned=set(keys))
                self.copied_blocks += upto - have
                copy_s += self.cost.copy_s((upto - have) * self.bt)
        hit = p.cache.match(keys)
        p.cache.touch(keys[:hit])
        req.cached = min(hit * self.bt, req.tr.input_len - 1)
        start = self.now + copy_s
        new = req.tr.input_len - req.cached
        if p.shape.stages == 1:
            req.compute_s = self.cost.prefill_s(new, req.cached)
            end = next_at = start + req.compute_s
        else:  # through the stages in chunks; the next prompt enters once stage 0 is free
            per, hops = stage_plan(
                self.cost.prefill_s, self.cost.hidden_copy_s, new, req.cached, p.shape
            )
            end, p.free = run_pipeline(per, hops, p.free, start)
            req.compute_s = end - start
            next_at = p.free[0]
        self._at(end, PREFILL_END, (p, req))
        self._at(next_at, PREFILL_NEXT, p)

    def _prefill_next(self, p: SimPrefill) -> None:
        p.job = None
        if p.queue:
            self._start_prefill(p)

    def _store(self, p: SimPrefill, keys, pinned) -> None:
        new, evicted = p.cache.insert(keys, pinned)
        if new:
            self.conductor.on_event(p.name, {"type": "stored", "keys": new, "source": p.name})
        if evicted:
            self.conductor.on_event(p.name, {"type": "removed", "keys": evicted, "source": p.name})

    def _prefill_end(self, job: tuple[SimPrefill, SimRequest]) -> None:
        p, req = job
        keys = req.tr.hash_ids
        self._store(p, keys, pinned=set(keys))
        if self.pool is not None:
            new, evicted = self.pool.insert(keys, set(keys))
            if new:
                self.conductor.on_event("pool", {"type": "stored", "keys": new})
            if evicted:
                self.conductor.on_event("pool", {"type": "removed", "keys": evicted})
        self.prompt_tokens += req.tr.input_len
        self.cached_tokens += req.cached
        self.conductor.on_prefill_done(req.rid, self.now, req.compute_s, req.cached)
        req.t_first = self.now
        self.ttft[req.rid] = self.now - req.tr.arrival_s
        self._at(self.now + self.cost.stream_tail_s(req.tr.input_len), KV_ARRIVE, req)

    # -- decode ----------------------------------------------------------------------------------

    def _kv_arrive(self, req: SimRequest) -> None:
        d = self.decodes[req.decision.decode]
        tr = req.tr
        need = tr.input_len + tr.output_len
        if math.isfinite(self.cfg.tbt_slo_s) and not d.waiting:
            fits = d.reserved + need <= d.capacity and d.running < d.max_batch
            step = self.cost.decode_step_s(d.running + 1, d.ctx + tr.input_len)
            if not fits or step > self.cfg.tbt_slo_s:
                self.wasted_prefill_s += req.compute_s
                self.conductor.on_request_finished(req.rid, self.now)
                del self.ttft[req.rid]
                return self._finish(req, "rejected_decode")
        d.waiting.append(req)
        self._admit(d)

    def _admit(self, d: SimDecode) -> None:
        while d.waiting:
            req = d.waiting[0]
            need = req.tr.input_len + req.tr.output_len
            if d.running and (d.reserved + need > d.capacity or d.running >= d.max_batch):
                return
            d.waiting.popleft()
            if req.tr.output_len <= 1:  # the prefill's token was the whole answer
                self._complete(d, req, np.empty(0))
                continue
            d.running += 1
            d.reserved += need
            d.ctx += req.tr.input_len
            req.first_step = d.step
            self._seq += 1
            heapq.heappush(d.finishing, (d.step + req.tr.output_len - 2, self._seq, req))
        if d.running and not d.stepping:
            self._start_step(d)

    def _start_step(self, d: SimDecode) -> None:
        d.stepping = True
        d.last_step_s = self.cost.decode_step_s(d.running, d.ctx)
        self._at(self.now + d.last_step_s, STEP_END, d)

    def _step_end(self, d: SimDecode) -> None:
        d.stepping = False
        d.ends.append(self.now)
        done = d.step
        d.step += 1
        self.decode_steps += 1
        d.ctx += d.running
        if d.cache is None:
            self.conductor.on_decode_progress(d.name, self.now, d.running, d.ctx, d.last_step_s)
        while d.finishing and d.finishing[0][0] <= done:
            req = heapq.heappop(d.finishing)[2]
            d.running -= 1
            d.reserved -= req.tr.input_len + req.tr.output_len
            d.ctx -= req.tr.input_len + req.tr.output_len - 1
            ends = np.asarray(d.ends[req.first_step : done + 1])
            self._complete(d, req, np.diff(ends, prepend=req.t_first))
        if d.cache is None:
            self._admit(d)
        else:
            self._coloc_next(d)
        if d.running and not d.stepping and d.prefilling is None:
            self._start_step(d)

    def _complete(self, d: SimDecode, req: SimRequest, intervals: np.ndarray) -> None:
        if len(intervals):
            self.intervals[req.rid] = intervals
            k = max(1, len(intervals) // 10)
            top = (
                np.partition(intervals, len(intervals) - k)[-k:]
                if k < len(intervals)
                else intervals
            )
            self.tbt[req.rid] = float(top.mean())
        else:
            self.tbt[req.rid] = 0.0
        if d.cache is None:
            self.conductor.on_request_finished(req.rid, self.now, req.tr.output_len)
        self._finish(req, "completed")

    # -- colocated instances ---------------------------------------------------------------------

    def _coloc_arrive(self, req: SimRequest) -> None:
        d = min(self.coloc, key=lambda c: len(c.queue) + c.running + (c.prefilling is not None))
        d.queue.append(req)
        self._coloc_next(d)

    def _coloc_next(self, d: SimDecode) -> None:
        """The instance is free: prefill the next waiting request if its KV fits, else decode."""
        if d.prefilling is not None or d.stepping:
            return
        if d.queue:
            req = d.queue[0]
            need = req.tr.input_len + req.tr.output_len
            if not d.running or (d.reserved + need <= d.capacity and d.running < d.max_batch):
                d.queue.popleft()
                d.prefilling = req
                d.reserved += need
                keys = req.tr.hash_ids
                hit = d.cache.match(keys)
                d.cache.touch(keys[:hit])
                req.cached = min(hit * self.bt, req.tr.input_len - 1)
                req.compute_s = self.cost.prefill_s(req.tr.input_len - req.cached, req.cached)
                self._at(self.now + req.compute_s, COLOC_PREFILL_END, d)
                return
        if d.running:
            self._start_step(d)

    def _coloc_prefill_end(self, d: SimDecode) -> None:
        req, d.prefilling = d.prefilling, None
        tr = req.tr
        d.cache.insert(tr.hash_ids, set(tr.hash_ids))
        self.prompt_tokens += tr.input_len
        self.cached_tokens += req.cached
        req.t_first = self.now
        self.ttft[req.rid] = self.now - tr.arrival_s
        if tr.output_len <= 1:
            d.reserved -= tr.input_len + tr.output_len
            self._complete(d, req, np.empty(0))
        else:
            d.running += 1
            d.ctx += tr.input_len
            req.first_step = d.step
            self._seq += 1
            heapq.heappush(d.finishing, (d.step + tr.output_len - 2, self._seq, req))
        self._coloc_next(d)

    # -- load over time and results --------------------------------------------------------------

    def _sample(self, _obj) -> None:
        slo_t, slo_b = self.cfg.ttft_slo_s, self.cfg.tbt_slo_s
        pl = [self.conductor.prefill_queue_s(n, self.now) / slo_t for n in self.prefills]
        dl = [
            max(d.reserved / d.capacity, d.last_step_s / slo_b if d.running else 0.0)
            for d in self.decodes.values()
        ]
        acc, rej = self._window
        self.timeline.append((self.now, float(np.mean(pl)), float(np.mean(dl)), acc, rej))
        self._window = [0, 0]
        self._at(self.now + self.cfg.timeline_s, SAMPLE, None)

    def slo_share(self, ttft_slo_s: float, tbt_slo_s: float) -> float:
        """Share of all requests that completed within both SLOs (TBT: the FAST'25 metric)."""
        ok = sum(
            1
            for rid, o in self.outcome.items()
            if o == "completed" and self.ttft[rid] <= ttft_slo_s and self.tbt[rid] <= tbt_slo_s
        )
        return ok / max(1, len(self.requests))

    def summary(self, wall_s: float) -> dict:
        done = [r for r, o in self.outcome.items() if o == "completed"]
        ttft = np.array([self.ttft[r] for r in done]) if done else np.zeros(1)
        iv = np.concatenate(list(self.intervals.values())) if self.intervals else np.zeros(1)
        outcomes = list(self.outcome.values())
        cfg = self.cfg
        return {
            "requests": len(self.requests),
            "completed": len(done),
            "rejected": len(outcomes) - len(done),
            "rejected_at_arrival": outcomes.count("rejected_arrival"),
            "rejected_after_prefill": outcomes.count("rejected_decode"),
            "ttft_mean_s": float(ttft.mean()),
            "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p90_s": float(np.percentile(ttft, 90)),
            "tbt_p90_s": float(np.percentile(iv, 90)),
            "slo_met": self.slo_share(cfg.ttft_slo_s, cfg.tbt_slo_s),
            "cache_hit_rate": self.cached_tokens / max(1, self.prompt_tokens),
            "copied_blocks": self.copied_blocks,
            "wasted_prefill_s": self.wasted_prefill_s,
            "decode_steps": self.decode_steps,
            "sim_time_s": self.now,
            "wall_s": wall_s,
            "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
        }
