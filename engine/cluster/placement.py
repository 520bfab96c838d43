"""Where a request runs: one prefill worker and one decode worker, picked among the live ones.

The router asks a ``Placement``, the one protocol that lists every call the router makes to its
placement (``PlacementBase`` gives the reports as no-ops). The Conductor (KVCache-centric: prefix
match, queueing, transfer cost, the decode SLO), adapted by conductor_placement.ConductorPlacement,
is the router's default (RouterConfig.policy/rejection); ``RoundRobin`` stays for a router handed
it explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from engine.kvstore.block_events import BlockEvent


class WorkerView(NamedTuple):
    """What placement may know of a worker (from its registration and last heartbeat)."""

    worker_id: str
    role: str
    host: str
    running: int
    waiting: int
    kv_usage: float
    # A prefill group (chunked pipeline parallelism): its stages and chunk size; 1 and 0 for a
    # worker alone. A group is one prefill unit, ``worker_id`` its id (``group:NAME``).
    stages: int = 1
    chunk_tokens: int = 0


class Placed(NamedTuple):
    prefill: str
    decode: str


class Placement(Protocol):
    """The router's whole contract with its placement: every call the router makes to it.

    ``place`` decides; the rest are what the router reports as it happens (and two questions about
    the decision just made), each called directly, always. A policy that needs no reports
    inherits ``PlacementBase``'s no-ops. The router calls them all from its one IO thread; ``now``
    is the router's monotonic clock. (``decision.Placer`` is the Conductor's own interface, which
    ``conductor_placement.ConductorPlacement`` drives; the router knows only this one.)
    """

    def place(
        self,
        prompt_token_ids: Sequence[int],
        prefill: Sequence[WorkerView],
        decode: Sequence[WorkerView],
        priority: int = 0,
    ) -> Placed | None:
        """The workers for a request (prefill, decode), or None to reject it. ``priority``: the
        request's (vLLM's, lower first; always 0 under the fcfs scheduling policy)."""
        ...

    def rejection_error(self) -> Exception | None:
        """After ``place`` returned None: the error to answer (an SLO's 429), or None for the
        router's own "no live prefill and decode workers" (503)."""
        ...

    def planned_copies(self) -> Sequence[tuple[str, str, int, int]]:
        """After ``place`` accepted: block copies to do before the prefill, as (source worker,
        target worker, first block, end block) of the prompt's blocks."""
        ...

    def recent_decisions(self) -> Sequence[dict]:
        """The last placements and rejections, oldest first, as JSON-able maps (any thread; the
        dashboard's; conductor/decision_log.py lists their fields). Empty: none kept."""
        ...

    def bind(self, router_id: str) -> None:
        """``router_id`` (the router's id for this attempt) names the request placed last."""
        ...

    def prefill_started(self, router_id: str, now: float) -> None:
        """The prefill request left for its worker (after the reservation and any copy)."""
        ...

    def copy_done(self, router_id: str, blocks: int) -> None:
        """A planned block copy for ``router_id`` ended, ``blocks`` blocks copied."""
        ...

    def prefill_done(self, router_id: str, now: float, cached_tokens: int | None = None) -> None:
        """The first token came back from the prefill worker (``cached_tokens``: the prefix it
        really reused)."""
        ...

    def finished(self, router_id: str, now: float, output_tokens: int | None = None) -> None:
        """Completed, failed, aborted, or abandoned for a retry."""
        ...

    def worker_joined(self, worker_id: str, role: str, now: float) -> None:
        """A worker registered (``role`` prefill or decode), or a pool was added (``pool``)."""
        ...

    def group_joined(self, unit_id: str, stages: int, chunk_tokens: int, now: float) -> None:
        """A prefill group is up (every stage registered): one prefill unit of ``stages``
        pipelined stages cutting long prompts into chunks of ``chunk_tokens``. It goes by
        ``worker_left(unit_id)`` when a stage leaves or dies."""
        ...

    def worker_left(self, worker_id: str, now: float) -> None:
        """A worker (or a prefill group) died or said goodbye."""
        ...

    def on_event(self, worker_id: str, event: BlockEvent) -> bool:
        """A published ``stored``/``removed`` block event of that worker or pool (checked
        already); False when it was not taken (unknown source, another namespace)."""
        ...

    def decode_progress(
        self, worker_id: str, now: float, batch: float, tokens: float, step_s: float
    ) -> None:
        """A decode worker's mean step over its last heartbeat interval."""
        ...


class PlacementBase:
    """``Placement``'s reports as no-ops and its questions answered "nothing": a policy that only
    places subclasses this and defines ``place``."""

    def place(
        self,
        prompt_token_ids: Sequence[int],
        prefill: Sequence[WorkerView],
        decode: Sequence[WorkerView],
        priority: int = 0,
    ) -> Placed | None:
        raise NotImplementedError

    def rejection_error(self) -> Exception | None:
        return None

    def planned_copies(self) -> Sequence[tuple[str, str, int, int]]:
        return ()

    def recent_decisions(self) -> Sequence[dict]:
        return ()

    def bind(self, router_id: str) -> None:
        pass

    def prefill_started(self, router_id: str, now: float) -> None:
        pass

    def copy_done(self, router_id: str, blocks: int) -> None:
        pass

    def prefill_done(self, router_id: str, now: float, cached_tokens: int | None = None) -> None:
        pass

    def finished(self, router_id: str, now: float, output_tokens: int | None = None) -> None:
        pass

    def worker_joined(self, worker_id: str, role: str, now: float) -> None:
        pass

    def group_joined(self, unit_id: str, stages: int, chunk_tokens: int, now: float) -> None:
        pass

    def worker_left(self, worker_id: str, now: float) -> None:
        pass

    def on_event(self, worker_id: str, event: BlockEvent) -> bool:
        return False

    def decode_progress(
        self, worker_id: str, now: float, batch: float, tokens: float, step_s: float
    ) -> None:
        pass


class RoundRobin(PlacementBase):
    """Each role's live workers in turn (sorted by id, so the order is stable across joins)."""

    def __init__(self) -> None:
        self._next = {"prefill": 0, "decode": 0}

    def _pick(self, role: str, workers: Sequence[WorkerView]) -> str | None:
        if not workers:
            return None
        ids = sorted(w.worker_id for w in workers)
        i = self._next[role] % len(ids)
        self._next[role] = i + 1
        return ids[i]

    def place(self, prompt_token_ids, prefill, decode, priority=0) -> Placed | None:
        p, d = self._pick("prefill", prefill), self._pick("decode", decode)
        if p is None or d is None:
            return None
        return Placed(p, d)
