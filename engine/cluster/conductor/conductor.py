"""The Conductor: places each request on a prefill and a decode instance, or refuses it early.

Mooncake's Algorithm 1 (FAST'25 §4.1; arXiv-v3 §6-7). For a request's prompt block hashes it
estimates, per prefill instance, TTFT = transfer of the blocks that must move + queue + prefill
of the unmatched part, and picks by the selected policy:

- ``random``, ``round_robin``: ignore load and cache (the instance still reuses its own prefix).
- ``load``: the shortest estimated queue.
- ``cache_aware`` (the paper's "local cache-aware"): the lowest TTFT using each instance's own
  prefix only. (Pure longest-prefix-match would send every request that shares a system prompt to
  one instance; the paper's local variant weighs the queue too.)
- ``kvcentric`` (default, "global cache-aware"): as cache_aware, but when the best prefix held
  anywhere exceeds an instance's own by more than ``balancing_threshold`` times, that instance may
  copy the missing blocks first (if the copy is cheaper than recomputing them): hot prefixes
  replicate onto the instances that serve them.

The decode instance is the one with the lowest estimated TBT once the request joins. Rejection
(``rejection.py``): ``none`` is the paper's baseline, each stage refusing only work it cannot do
in time (here: TTFT over the SLO at arrival; a decode worker may still refuse after the prefill);
``early`` also refuses when the decode pool's load now would miss the TBT SLO; ``predicted``
when the load predicted for the moment the prefill ends would.

Pure: state changes only through the methods (see decision.Placer); the clock is an argument.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from engine.cluster.conductor import decision as pl
from engine.cluster.conductor.cost_model import PAPER, CostModel
from engine.cluster.conductor.pipeline import SINGLE, PipelineShape, pipelined_prefill_s
from engine.cluster.conductor.prefill_queue import PrefillQueue
from engine.cluster.conductor.prefix_index import PrefixIndex
from engine.cluster.conductor.rejection import (
    REJECTIONS,
    DecodeState,
    pool_load,
    tbt_at,
    tbt_committed,
    tbt_now,
)
from engine.cluster.conductor.time_models import PrefillTimeModel, TbtModel
from engine.kvstore.block_events import BlockEvent

POLICIES = ("random", "round_robin", "load", "cache_aware", "kvcentric")
DECODE_WINDOW = 128  # decodes the uniform decode time t_d is the mean of


@dataclass(frozen=True)
class ConductorConfig:
    policy: str = "kvcentric"
    rejection: str = "predicted"
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1
    # Unstated in the papers ("currently adjusted manually"); swept in docs/reproduction.md.
    balancing_threshold: float = 1.5
    block_tokens: int = 512  # tokens per hashed block
    decode_time_s: float = 0.0  # t_d of the prediction; 0: the mean of the recent decodes
    prior_decode_time_s: float = 10.0  # t_d until a decode has been measured
    # Output tokens a request adds to its decode instance's KV, until finished requests report
    # theirs (then their mean): the decode choice and the capacity check count prompt + this.
    prior_output_tokens: int = 256
    seed: int = 0  # of the random policy
    # Roles whose blocks kvcentric may copy to a prefill instance: only those the cluster can
    # really copy from (a planned copy that never happens makes every estimate after it wrong).
    copy_sources: tuple[str, ...] = ("prefill", "pool")
    # Refit the TBT model every this many decode reports (the simulator reports every step; a
    # cluster's decode workers report a mean per heartbeat, so far fewer arrive).
    tbt_refit_every: int = 256
    # A copy from a prefill instance starts when the source's current work lets it (a worker
    # serves it between its forward passes): it is estimated to wait for the source's queue, up
    # to this many seconds (the router's copy timeout, after which the prefill runs without
    # it). 0: copies start at once (the simulator's instances copy without delay).
    copy_wait_cap_s: float = 0.0
    # The instances' scheduling policy (engine/core/scheduler.py): under "priority" a request
    # waits in a prefill queue only for the head and the requests of a priority value at most
    # its own (prefill_queue.py), and goes ahead of the others.
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(
                f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.rejection not in REJECTIONS:
            raise ValueError(f"rejection must be one of {REJECTIONS}, got {self.rejection!r}")
        if self.prior_output_tokens < 0:
            raise ValueError(f"prior_output_tokens must be >= 0, got {self.prior_output_tokens}")
        for f in ("ttft_slo_s", "tbt_slo_s", "prior_decode_time_s"):
            if not getattr(self, f) > 0:
                raise ValueError(f"{f} must be > 0, got {getattr(self, f)}")
        if not self.balancing_threshold >= 1:
            raise ValueError(f"balancing_threshold must be >= 1, got {self.balancing_threshold}")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")
        if self.decode_time_s < 0:
            raise ValueError(f"decode_time_s must be >= 0, got {self.decode_time_s}")
        bad = [r for r in self.copy_sources if r not in ("prefill", "pool")]
        if bad:
            raise ValueError(f"copy_sources must be roles among prefill and pool, got {bad}")
        if self.copy_wait_cap_s < 0:
            raise ValueError(f"copy_wait_cap_s must be >= 0, got {self.copy_wait_cap_s}")
        if self.tbt_refit_every < 1:
            raise ValueError(f"tbt_refit_every must be >= 1, got {self.tbt_refit_every}")


class Estimate(NamedTuple):
    instance_id: str
    prefix_blocks: int  # after copies
    local_blocks: int
    transfer_s: float
    queue_s: float
    prefill_s: float
    # How long the prefill keeps the instance busy (a group's stages each: the next prompt
    # starts behind it while its last chunks finish); None: prefill_s (a single instance).
    busy_s: float | None = None

    @property
    def ttft_s(self) -> float:
        return self.transfer_s + self.queue_s + self.prefill_s


class Conductor:
    def __init__(self, config: ConductorConfig | None = None, prior: CostModel = PAPER) -> None:
        self.config = config or ConductorConfig()
        self.prior = prior
        self.index = PrefixIndex()
        self.prefill_model = PrefillTimeModel(prior)
        self.tbt_model = TbtModel(prior, refit_every=self.config.tbt_refit_every)
        self._prefills: dict[str, PrefillQueue] = {}
        self._decodes: dict[str, DecodeState] = {}
        self._pools: list[str] = []
        self._where: dict[str, tuple[str, str]] = {}  # request -> (prefill, decode)
        self._prefill_est: dict[str, tuple[int, int]] = {}  # request -> (new, cached) tokens
        self._rng = random.Random(self.config.seed)
        self._rr = 0
        # Recent decode durations: under a changing load the decode time changes with the TBT.
        self._decode_times: deque[float] = deque(maxlen=DECODE_WINDOW)
        self._output_sum = 0
        self._output_count = 0
        self.copies_planned = 0

    # -- cluster membership and events ---------------------------------------------------------

    def add_instance(
        self,
        instance_id: str,
        role: str,
        kv_capacity_tokens: int = 0,
        shape: PipelineShape = SINGLE,
    ) -> None:
        """``shape``: a prefill group's stages and chunk size (chunked pipeline parallelism,
        pipeline.py); the default is a single instance."""
        if role not in pl.ROLES:
            raise ValueError(f"role must be one of {pl.ROLES}, got {role!r}")
        if kv_capacity_tokens < 0:
            raise ValueError(f"kv_capacity_tokens must be >= 0, got {kv_capacity_tokens}")
        if shape.stages > 1 and role != "prefill":
            raise ValueError(f"only prefill instances form pipeline groups, not {role!r}")
        if role == "decode":
            self._decodes[instance_id] = DecodeState(
                instance_id, kv_capacity_tokens, self.prior.max_batch
            )
            return
        self.index.add_holder(instance_id)
        if role == "prefill":
            self._prefills[instance_id] = PrefillQueue(instance_id, shape)
        elif instance_id not in self._pools:
            self._pools.append(instance_id)

    def remove_instance(self, instance_id: str, now: float) -> list[str]:
        self.index.remove_holder(instance_id)
        if instance_id in self._pools:
            self._pools.remove(instance_id)
        self._prefills.pop(instance_id, None)
        self._decodes.pop(instance_id, None)
        lost = [r for r, (p, d) in self._where.items() if instance_id in (p, d)]
        for r in lost:
            self.on_request_finished(r, now)
        return lost

    def on_event(self, instance_id: str, event: BlockEvent | Mapping) -> bool:
        return self.index.apply(instance_id, event)

    # -- the decision ----------------------------------------------------------------------------

    def estimate(
        self,
        instance_id: str,
        keys: Sequence[Hashable],
        prompt_len: int,
        now: float,
        best: tuple[int, str | None] = (0, None),
        priority: int | None = None,
    ) -> Estimate:
        """TTFT parts on one prefill instance; with ``best`` = (blocks, holder) the instance may
        copy the blocks it lacks from the holder (kvcentric); ``priority``: the request's under
        the priority policy (None: fcfs), which decides what of the queue it waits for."""
        bt = self.config.block_tokens
        local = self.index.match(instance_id, keys)
        queue_s = self._prefills[instance_id].queue_s(now, priority)
        cap = prompt_len - 1  # the last token is always computed
        cached = min(local * bt, cap)
        timing = self._prefill_time(instance_id, prompt_len, cached)
        own = Estimate(instance_id, local, local, 0.0, queue_s, *timing)
        best_len, holder = best
        if holder is None or holder == instance_id or best_len <= local:
            return own
        if local and best_len / local <= self.config.balancing_threshold:
            return own
        cached_b = min(best_len * bt, cap)
        wait = 0.0
        if holder in self._prefills and self.config.copy_wait_cap_s > 0:
            wait = min(self._prefills[holder].queue_s(now), self.config.copy_wait_cap_s)
        copied = Estimate(
            instance_id,
            best_len,
            local,
            wait + self.prior.copy_s(cached_b - cached),
            queue_s,
            *self._prefill_time(instance_id, prompt_len, cached_b),
        )
        return copied if copied.ttft_s < own.ttft_s else own

    def _prefill_time(self, instance_id: str, prompt_len: int, cached: int) -> tuple[float, float]:
        """(seconds to the first token, seconds the instance is busy) of a prefill of
        ``prompt_len`` tokens with ``cached`` of them held: on a group, pipelined over its stages
        (the fitted model times each chunk)."""
        shape = self._prefills[instance_id].shape
        return pipelined_prefill_s(
            self.prefill_model.predict, self.prior.hidden_copy_s, prompt_len - cached, cached,
            shape,
        )  # fmt: skip

    def decide(
        self,
        request_id: str,
        block_hashes: Sequence[Hashable],
        prompt_len: int,
        now: float,
        output_tokens: int | None = None,
        priority: int = 0,
    ) -> pl.Decision:
        """``output_tokens``: the request's output length when known (an oracle the simulator
        can give, to bound what a better decode-time prediction would gain): its KV and its
        decode time (that many steps at the estimated TBT) then replace the averages.

        ``priority`` (under the scheduling policy "priority"; ignored under fcfs): the TTFT is
        estimated with the part of the prefill queue it waits for (prefill_queue.py), and checked
        against the SLO; the decode instance and the decode-load check are judged at the moment
        its prefill would end in arrival order, the same for every priority. So at one moment,
        for one prompt, the verdict is monotone in priority: if a request is admitted, one of
        any lower priority value would be too (and placed on the same decode instance)."""
        if prompt_len < 1:
            raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
        if output_tokens is not None and output_tokens < 0:
            raise ValueError(f"output_tokens must be >= 0, got {output_tokens}")
        if request_id in self._where:
            raise ValueError(f"request_id {request_id!r} is already placed")
        keys = list(block_hashes)
        if not self._prefills:
            return _reject(request_id, pl.REJECT_NO_PREFILL)
        if not self._decodes:
            return _reject(request_id, pl.REJECT_NO_DECODE)
        prio = priority if self.config.scheduling_policy == "priority" else None
        est = self._choose_prefill(keys, prompt_len, now, prio)
        out = self.expected_output_tokens() if output_tokens is None else output_tokens
        tokens = prompt_len + out  # KV it will hold on its decode
        t_decode = now + (
            est.ttft_s if prio is None else self._fcfs_ttft(est, keys, prompt_len, now)
        )
        decode, est_tbt = self._choose_decode(tokens, t_decode)
        reason = self._rejection(est.ttft_s, decode, tokens, t_decode)
        if reason:
            return _reject(request_id, reason, est.ttft_s, est_tbt)
        copies: tuple[pl.BlockCopy, ...] = ()
        if est.prefix_blocks > est.local_blocks:
            src = self._holder_of(keys, est.prefix_blocks, exclude=est.instance_id)
            copies = (
                pl.BlockCopy(
                    src, est.instance_id, tuple(keys[est.local_blocks : est.prefix_blocks])
                ),
            )
            self.copies_planned += 1
        # The chosen instance will hold the whole prompt's blocks (Mooncake: "the Conductor
        # updates the chosen instance's cache"); its events will confirm or correct this.
        self.index.stored(est.instance_id, keys)
        busy = est.prefill_s if est.busy_s is None else est.busy_s
        seconds = est.transfer_s + busy
        for later in self._prefills[est.instance_id].push(request_id, seconds, now, prio):
            where = self._where.get(later)  # its prefill ends that much later
            if where is not None and where[1] in self._decodes:
                self._decodes[where[1]].delay(later, seconds)
        cached = min(est.prefix_blocks * self.config.block_tokens, prompt_len - 1)
        self._prefill_est[request_id] = (prompt_len - cached, cached)
        duration = None
        if output_tokens is not None and math.isfinite(est_tbt):
            duration = output_tokens * est_tbt
        self._decodes[decode].add_incoming(request_id, tokens, now + est.ttft_s, duration)
        self._where[request_id] = (est.instance_id, decode)
        return pl.Decision(
            request_id,
            True,
            est.instance_id,
            decode,
            copies,
            est.prefix_blocks,
            est.ttft_s,
            est_tbt,
            "",
        )

    def _fcfs_ttft(self, est: Estimate, keys: list, prompt_len: int, now: float) -> float:
        """The TTFT of the prefill placement in arrival order (the request's priority ignored):
        where the decode side is judged under the priority policy."""
        if self.config.policy in ("random", "round_robin"):  # the pick does not depend on it
            return self.estimate(est.instance_id, keys, prompt_len, now).ttft_s
        return self._choose_prefill(keys, prompt_len, now, None).ttft_s

    def _choose_prefill(
        self, keys: list, prompt_len: int, now: float, priority: int | None = None
    ) -> Estimate:
        ids = list(self._prefills)
        policy = self.config.policy
        if policy == "random":
            return self.estimate(self._rng.choice(ids), keys, prompt_len, now, priority=priority)
        if policy == "round_robin":
            self._rr = (self._rr + 1) % len(ids)
            return self.estimate(ids[self._rr], keys, prompt_len, now, priority=priority)
        if policy == "load":
            pick = min(ids, key=lambda i: self._prefills[i].queue_s(now, priority))
            return self.estimate(pick, keys, prompt_len, now, priority=priority)
        best: tuple[int, str | None] = (0, None)
        if policy == "kvcentric":
            src = self.config.copy_sources
            holders = (ids if "prefill" in src else []) + (self._pools if "pool" in src else [])
            for holder in holders:
                n = self.index.match(holder, keys)
                if n > best[0]:
                    best = (n, holder)
        ests = [self.estimate(i, keys, prompt_len, now, best, priority) for i in ids]
        return min(ests, key=lambda e: (e.ttft_s, e.queue_s))

    def _choose_decode(self, tokens: int, t_ready: float) -> tuple[str, float]:
        """The least loaded decode instance: with ``predicted`` rejection, by the TBT predicted
        for when this request's prefill ends (``t_ready``); otherwise once every request placed
        on it (running or still in prefill) and this one decode together. Load is ranked by TBT
        without the capacity check, so instances that are all full still rank by how full.
        Returns it and its committed TBT (inf if the request would not fit)."""
        predict = self.tbt_model.predict
        td = self.decode_time_s()
        keys = {}
        for d, s in self._decodes.items():
            committed = tbt_committed(s, predict, tokens, capacity=False)
            if self.config.rejection == "predicted":
                keys[d] = (tbt_at(s, predict, t_ready, td, tokens, capacity=False), committed)
            else:
                keys[d] = (committed,)
        decode = min(keys, key=keys.__getitem__)
        return decode, tbt_committed(self._decodes[decode], predict, tokens)

    def _holder_of(self, keys: list, blocks: int, exclude: str) -> str:
        src = self.config.copy_sources
        holders = (list(self._prefills) if "prefill" in src else []) + (
            self._pools if "pool" in src else []
        )
        for holder in holders:
            if holder != exclude and self.index.match(holder, keys) >= blocks:
                return holder
        raise AssertionError("a copy was planned from a holder that does not exist")

    def expected_output_tokens(self) -> int:
        if self._output_count == 0:
            return self.config.prior_output_tokens
        return round(self._output_sum / self._output_count)

    def decode_time_s(self) -> float:
        if self.config.decode_time_s > 0:
            return self.config.decode_time_s
        if not self._decode_times:
            return self.config.prior_decode_time_s
        return sum(self._decode_times) / len(self._decode_times)

    def _rejection(self, ttft_s: float, decode: str, tokens: int, t_decode: float) -> str:
        """Why to refuse (a decision.REJECT_*), or "": the TTFT over its SLO, or the decode pool's
        load (``predicted``: at ``t_decode``, when the prefill ends) over the TBT SLO."""
        cfg = self.config
        if ttft_s > cfg.ttft_slo_s:
            return pl.REJECT_TTFT
        if cfg.rejection == "none" or self._decode_pool_idle():
            return ""
        predict = self.tbt_model.predict
        if cfg.rejection == "early":
            tbts = [
                tbt_now(s, predict, tokens if d == decode else 0) for d, s in self._decodes.items()
            ]
        else:
            td = self.decode_time_s()
            tbts = [
                tbt_at(s, predict, t_decode, td, tokens if d == decode else 0)
                for d, s in self._decodes.items()
            ]
        return pl.REJECT_TBT if pool_load(tbts, cfg.tbt_slo_s) > 1.0 else ""

    def _decode_pool_idle(self) -> bool:
        """No decode instance runs or expects a request: the pool is not loaded, so the TBT
        rejection (load control) lets a request in whatever the model says. Refusing it would
        serve nobody and teach the model nothing: an estimate once fitted on slow steps (a
        recompute's prefill, a busy host) would refuse every request of an idle cluster for
        good, as the trace chaos run found (docs/reliability.md)."""
        return all(not s.running and not s.incoming for s in self._decodes.values())

    # -- what happened -----------------------------------------------------------------------------

    def on_prefill_done(
        self,
        request_id: str,
        now: float,
        seconds: float | None = None,
        cached_tokens: int | None = None,
    ) -> None:
        where = self._where.get(request_id)
        if where is None:
            return
        group = False
        if where[0] in self._prefills:
            self._prefills[where[0]].pop(request_id, now)
            group = self._prefills[where[0]].shape.stages > 1
        new, cached = self._prefill_est.pop(request_id, (0, 0))
        # The fitted model times a whole prefill on one instance; a group's pipelined time is
        # derived from it, so a group's measurement does not train it.
        if seconds is not None and new > 0 and not group:
            if cached_tokens is not None:
                new, cached = new + cached - cached_tokens, cached_tokens
            self.prefill_model.observe(new, cached, seconds)
        if where[1] in self._decodes:
            self._decodes[where[1]].start(request_id, now)

    def on_decode_progress(
        self, instance_id: str, now: float, batch: float, tokens: float, step_s: float
    ) -> None:
        if batch > 0 and step_s > 0 and math.isfinite(step_s):
            self.tbt_model.observe(batch, tokens, step_s)

    def on_request_finished(
        self, request_id: str, now: float, output_tokens: int | None = None
    ) -> None:
        if output_tokens is not None and output_tokens >= 0:
            self._output_sum += output_tokens
            self._output_count += 1
        where = self._where.pop(request_id, None)
        self._prefill_est.pop(request_id, None)
        if where is None:
            return
        prefill, decode = where
        if prefill in self._prefills:
            self._prefills[prefill].pop(request_id, now)
        state = self._decodes.get(decode)
        if state is not None:
            started = state.running.get(request_id)
            if started is not None:
                self._decode_times.append(now - started[1])
            state.drop(request_id)

    # -- views for tests, metrics and the simulator's plots ---------------------------------------

    def prefill_queue_s(self, instance_id: str, now: float) -> float:
        return self._prefills[instance_id].queue_s(now)

    def decode_state(self, instance_id: str) -> DecodeState:
        return self._decodes[instance_id]

    def placed(self) -> int:
        return len(self._where)


def _reject(request_id: str, reason: str, ttft: float = math.inf, tbt: float = math.inf):
    return pl.Decision(request_id, False, None, None, (), 0, ttft, tbt, reason)
