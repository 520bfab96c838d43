"""Where a request runs: one prefill worker and one decode worker, picked among the live ones.

The router asks a ``Placement``; the Conductor (KVCache-centric: prefix match, queueing, transfer
cost, the decode SLO), adapted by conductor_placement.ConductorPlacement, is the router's default
(RouterConfig.policy/rejection); ``RoundRobin`` stays for a router handed it explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol


class WorkerView(NamedTuple):
    """What placement may know of a worker (from its registration and last heartbeat)."""

    worker_id: str
    role: str
    host: str
    running: int
    waiting: int
    kv_usage: float


class Placed(NamedTuple):
    prefill: str
    decode: str


class Placement(Protocol):
    def place(
        self,
        prompt_token_ids: Sequence[int],
        prefill: Sequence[WorkerView],
        decode: Sequence[WorkerView],
    ) -> Placed | None:
        """The workers for a request, or None to reject it (no candidate)."""
        ...


class RoundRobin:
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

    def place(self, prompt_token_ids, prefill, decode) -> Placed | None:
        p, d = self._pick("prefill", prefill), self._pick("decode", decode)
        if p is None or d is None:
            return None
        return Placed(p, d)
