"""The Conductor behind the router's ``Placement`` interface (engine/cluster/placement.py).

That interface is one call, ``place(prompt_token_ids, prefill, decode) -> (prefill, decode) |
None``, with the live workers as the router sees them and no request id, clock or lifecycle. This
adapter supplies what the Conductor needs from it:

- membership: workers that appear are registered, workers that vanish are removed;
- block hashes: the prompt's chained block hashes (engine/kvcache/prefix_hash.py, the names the
  workers and pools publish in their ``stored``/``removed`` events, fed through ``on_event``);
- a clock (``clock``, monotonic by default: this adapter is the router's side, not the
  Conductor's, which stays pure) and request ids of its own;
- a lifecycle: with no report of prefill and decode ends, a placed request is taken as done with
  its prefill at the estimated end and with its decode ``decode_time_s`` later, so the
  Conductor's queues drain as estimated instead of growing without bound (a request the router
  ``bind``s leaves this estimate: its reports drive the Conductor's decision.Placer methods).

A rejection returns None (the router answers it) and leaves the Decision, with its reason, in
``last_decision``; ``rejection_error`` turns an SLO refusal into ``RequestRejectedError`` (HTTP
429 with the reason; no live worker stays the router's 503).

The router reports what it sees through the rest of ``Placement`` (placement.py, which lists
every call; ``RoundRobin`` inherits them as no-ops from ``PlacementBase``): ``worker_joined``/
``worker_left`` (registrations, deaths and goodbyes), ``on_event`` (the workers' published block
events, which the router subscribes to), ``bind`` (the router's id for the request just placed),
``prefill_done`` (the first token came back from the prefill worker, with the prefix it really
reused) and ``finished`` (completed, failed, aborted or abandoned for a retry). A bound request
leaves the estimated lifecycle: its queues drain on these reports. The prefill's measured time is
the router's view (from ``prefill_started``, or the placement when that is not reported, to the
first token: it includes the transfer's tail, not the decode reservation or a block copy) and is
fed to the prefill-time model only when the worker had no other request of ours in prefill, so
that queueing is not taken for compute. Decode workers report their mean step time, batch and KV
tokens in every heartbeat (``decode_progress``), which the TBT model is refitted on.

Block copies: ``planned_copies`` gives the router the copies of the request just placed, as
(source, target, first block, end block) of its prompt; the router has copies between prefill
workers done (block_copy.py) and reports each with ``copy_done``. Copies from a pool need no
router: the target's pool lookup performs them.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence

from engine.cluster.conductor.conductor import Conductor, ConductorConfig
from engine.cluster.conductor.cost_model import get_cost_model
from engine.cluster.conductor.decision import REJECT_TBT, REJECT_TTFT, Decision
from engine.cluster.conductor.decision_log import DecisionLog
from engine.cluster.conductor.pipeline import PipelineShape
from engine.cluster.conductor.prefix_index import EventError
from engine.cluster.placement import Placed, PlacementBase
from engine.core.scheduler import QueueFullError
from engine.kvcache.prefix_hash import hash_blocks
from engine.kvstore.block_events import BlockEvent

# The prior of the router's Conductor until measurements arrive: the engine's default model on a
# CPU like this one (engine/cluster/conductor/cost_model.py states its constants).
ROUTER_COST_MODEL = "smollm2-cpu"


class RequestRejectedError(QueueFullError):
    """The Conductor refused the request early (HTTP 429); ``reason`` is a decision.REJECT_*."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def make_placement(cfg) -> ConductorPlacement:
    """The router's placement from its config (``policy``, ``rejection``, ``ttft_slo_s``,
    ``tbt_slo_s``, ``block_size``, ``scheduling_policy``); ConductorConfig validates them, naming
    the field."""
    conductor = Conductor(
        ConductorConfig(
            policy=cfg.policy,
            rejection=cfg.rejection,
            ttft_slo_s=cfg.ttft_slo_s,
            tbt_slo_s=cfg.tbt_slo_s,
            block_tokens=cfg.block_size,
            tbt_refit_every=16,  # one report per decode worker per heartbeat
            copy_wait_cap_s=cfg.copy_timeout_s,  # the router waits no longer for a copy
            scheduling_policy=cfg.scheduling_policy,
        ),
        prior=get_cost_model(ROUTER_COST_MODEL),
    )
    return ConductorPlacement(conductor, block_size=cfg.block_size)


class ConductorPlacement(PlacementBase):
    def __init__(
        self,
        conductor: Conductor,
        block_size: int = 16,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if conductor.config.block_tokens != block_size:
            raise ValueError(
                f"block_size {block_size} must equal the Conductor's block_tokens "
                f"{conductor.config.block_tokens} (token counts are blocks x block size)"
            )
        self.conductor = conductor
        self.block_size = block_size
        self.clock = clock
        self.last_decision: Decision | None = None
        self.decisions = DecisionLog()  # the last placements and rejections (the dashboard's)
        self._ids = itertools.count()
        self._known: dict[str, str] = {}  # worker id -> role
        self._due: list[tuple[float, int, str, str]] = []  # (time, seq, what, request id)
        self._seq = itertools.count()
        self._bound: dict[str, tuple[str, float, bool]] = {}  # router id -> (ours, placed, alone)
        self._reported: set[str] = set()  # our ids the router reports the lifecycle of
        self._in_prefill: dict[str, set[str]] = {}  # prefill worker -> router ids in prefill
        self.copies_done = 0  # block copies between prefill workers the router reported
        self.blocks_copied = 0

    def _sync(self, prefill: Sequence, decode: Sequence, now: float) -> None:
        live = {w.worker_id: "prefill" for w in prefill}
        live.update({w.worker_id: "decode" for w in decode})
        gone = [w for w, role in self._known.items() if role != "pool" and w not in live]
        for wid in gone:  # pools are not workers: they come and go by worker_joined/left
            self.conductor.remove_instance(wid, now)
            del self._known[wid]
        for w in prefill:
            if w.worker_id not in self._known and getattr(w, "stages", 1) > 1:
                self.group_joined(w.worker_id, w.stages, w.chunk_tokens, now)
        for wid, role in live.items():
            if wid not in self._known:
                self.conductor.add_instance(wid, role)
                self._known[wid] = role

    def _expire(self, now: float) -> None:
        while self._due and self._due[0][0] <= now:
            t, _, what, rid = heapq.heappop(self._due)
            if rid in self._reported:
                continue
            if what == "prefill":
                self.conductor.on_prefill_done(rid, t)
                end = t + self.conductor.decode_time_s()
                heapq.heappush(self._due, (end, next(self._seq), "finish", rid))
            else:
                self.conductor.on_request_finished(rid, t)

    def on_event(self, worker_id: str, event: BlockEvent) -> bool:
        try:
            return self.conductor.on_event(worker_id, event)
        except EventError:
            return False  # a malformed event is a lost hint, never a stopped router

    # -- what the router reports (placement.Placement) ------------------------------------------

    def worker_joined(self, worker_id: str, role: str, now: float) -> None:
        if worker_id in self._known:  # a restart under the same name: a fresh instance
            self.worker_left(worker_id, now)
        self.conductor.add_instance(worker_id, role)
        self._known[worker_id] = role

    def group_joined(self, unit_id: str, stages: int, chunk_tokens: int, now: float) -> None:
        """A prefill group: one prefill unit whose TTFT is the pipelined time (pipeline.py)."""
        if unit_id in self._known:
            self.worker_left(unit_id, now)
        shape = PipelineShape(stages, max(1, chunk_tokens))
        self.conductor.add_instance(unit_id, "prefill", shape=shape)
        self._known[unit_id] = "prefill"

    def worker_left(self, worker_id: str, now: float) -> None:
        if self._known.pop(worker_id, None) is not None:
            self.conductor.remove_instance(worker_id, now)
        self._in_prefill.pop(worker_id, None)

    def bind(self, router_id: str) -> None:
        """``router_id`` names the request ``place`` accepted last."""
        d = self.last_decision
        if d is None or not d.accepted:
            return
        self.decisions.name_last(router_id)
        busy = self._in_prefill.setdefault(d.prefill, set())
        self._bound[router_id] = (d.request_id, self.clock(), not busy)
        busy.add(router_id)
        self._reported.add(d.request_id)

    def prefill_started(self, router_id: str, now: float) -> None:
        """The prefill request left for its worker (after the decode reservation and any block
        copy): its measured time starts here, so waiting for a copy is not taken for compute."""
        bound = self._bound.get(router_id)
        if bound is not None:
            self._bound[router_id] = (bound[0], now, bound[2])

    def prefill_done(self, router_id: str, now: float, cached_tokens: int | None = None) -> None:
        bound = self._bound.get(router_id)
        if bound is None:
            return
        rid, placed, alone = bound
        self._left_prefill(router_id)
        seconds = now - placed if alone else None
        self.conductor.on_prefill_done(rid, now, seconds, cached_tokens)

    def finished(self, router_id: str, now: float, output_tokens: int | None = None) -> None:
        bound = self._bound.pop(router_id, None)
        if bound is None:
            return
        self._left_prefill(router_id)
        self._reported.discard(bound[0])
        self.conductor.on_request_finished(bound[0], now, output_tokens)

    def planned_copies(self) -> list[tuple[str, str, int, int]]:
        """The block copies of the request ``place`` accepted last: (source, target, first
        block, end block) of its prompt's blocks."""
        d = self.last_decision
        if d is None or not d.accepted:
            return []
        out = []
        for c in d.copies:
            start = d.prefix_blocks - len(c.keys)
            out.append((c.src, c.dst, start, d.prefix_blocks))
        return out

    def copy_done(self, router_id: str, blocks: int) -> None:
        self.copies_done += 1
        self.blocks_copied += max(0, blocks)

    def decode_progress(
        self, worker_id: str, now: float, batch: float, tokens: float, step_s: float
    ) -> None:
        """A decode worker's mean step over its last heartbeat interval."""
        self.conductor.on_decode_progress(worker_id, now, batch, tokens, step_s)

    def _left_prefill(self, router_id: str) -> None:
        for ids in self._in_prefill.values():
            ids.discard(router_id)

    def recent_decisions(self) -> list[dict]:
        return self.decisions.snapshot()

    def rejection_error(self) -> RequestRejectedError | None:
        """The last refusal as a 429, if it was the SLOs' (no live worker is not a 429)."""
        d = self.last_decision
        if d is None or d.accepted or d.reason not in (REJECT_TTFT, REJECT_TBT):
            return None
        what = "time to first token" if d.reason == REJECT_TTFT else "time between tokens"
        slo = (
            self.conductor.config.ttft_slo_s
            if d.reason == REJECT_TTFT
            else (self.conductor.config.tbt_slo_s)
        )
        est = d.est_ttft_s if d.reason == REJECT_TTFT else d.est_tbt_s
        return RequestRejectedError(
            d.reason,
            f"rejected by the cluster's admission ({d.reason}): the estimated {what} "
            f"{est:.3g} s would exceed its SLO of {slo:.3g} s; retry later",
        )

    def place(
        self,
        prompt_token_ids: Sequence[int],
        prefill: Sequence,
        decode: Sequence,
        priority: int = 0,
    ) -> Placed | None:
        now = self.clock()
        self._sync(prefill, decode, now)
        self._expire(now)
        keys = hash_blocks(list(prompt_token_ids), self.block_size)
        rid = f"placement-{next(self._ids)}"
        d = self.conductor.decide(rid, keys, max(1, len(prompt_token_ids)), now, priority=priority)
        self.last_decision = d
        self.decisions.record(d)
        if not d.accepted:
            return None
        heapq.heappush(self._due, (now + d.est_ttft_s, next(self._seq), "prefill", rid))
        return Placed(d.prefill, d.decode)
