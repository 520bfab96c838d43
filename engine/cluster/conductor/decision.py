"""The Conductor's decisions and the full interface through which it is driven.

Its driver owns the clock (and, in a cluster, the sockets); the placer owns the decisions. The
driver tells the placer what happens (instances up and down, published block events, a prefill
done with its measured time, decode steps, a request finished) and asks it, once per request,
where to run it.
Every method takes ``now`` from the caller (seconds on any monotonic clock): the placer never
reads a clock itself, so the simulator drives the same code on simulated time.

``Placer`` is the Conductor's own interface (``conductor.Conductor`` implements it), driven by
the simulator (engine/sim/simulator.py) on simulated time and, in a cluster, by
``conductor_placement.ConductorPlacement``. The router never sees it: the router knows only
``engine.cluster.placement.Placement``, the one protocol that lists every call it makes, which
ConductorPlacement implements by translating (worker ids, its clock, prompt block hashes) into
these calls.

A placer is not thread-safe: its driver calls it from one thread (the router's IO thread).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import NamedTuple, Protocol

from engine.kvstore.block_events import BlockEvent

ROLES = ("prefill", "decode", "pool")

# Why a request was refused (the router answers HTTP 429 with it).
REJECT_TTFT = "ttft_slo"  # the estimated time to first token exceeds the TTFT SLO
REJECT_TBT = "tbt_slo"  # decode load (now or predicted) would miss the TBT SLO
REJECT_NO_PREFILL = "no_prefill_instance"
REJECT_NO_DECODE = "no_decode_instance"


class BlockCopy(NamedTuple):
    """Blocks ``keys`` (a run of the request's prefix) to copy from ``src`` to ``dst`` before the
    prefill; ``src`` is a prefill instance or a pool. Copying replicates hot prefixes."""

    src: str
    dst: str
    keys: tuple[Hashable, ...]


class Decision(NamedTuple):
    request_id: str
    accepted: bool
    prefill: str | None  # None when rejected
    decode: str | None
    copies: tuple[BlockCopy, ...]  # to do before the prefill starts (empty: none)
    prefix_blocks: int  # leading blocks the prefill instance will hold once the copies are done
    est_ttft_s: float  # transfer + queue + prefill, as estimated
    est_tbt_s: float  # of the chosen decode instance once the request joins it
    reason: str  # "" when accepted, else one of the REJECT_* strings


class Placer(Protocol):
    def add_instance(self, instance_id: str, role: str, kv_capacity_tokens: int = 0) -> None:
        """A worker registered (``role`` in ROLES; capacity 0: unknown)."""

    def remove_instance(self, instance_id: str, now: float) -> list[str]:
        """A worker died or left: forget it; returns the requests that were placed on it."""

    def on_event(self, instance_id: str, event: BlockEvent | Mapping) -> bool:
        """A published ``stored``/``removed`` event from that instance (or pool), or the map of
        one (engine/kvstore/block_events.py)."""

    def decide(
        self,
        request_id: str,
        block_hashes: Sequence[Hashable],
        prompt_len: int,
        now: float,
    ) -> Decision: ...

    def on_prefill_done(
        self,
        request_id: str,
        now: float,
        seconds: float | None = None,
        cached_tokens: int | None = None,
    ) -> None:
        """The prefill ended (``seconds``: its measured compute time; ``cached_tokens``: the
        prefix it really reused); the request moves to its decode instance."""

    def on_decode_progress(
        self, instance_id: str, now: float, batch: float, tokens: float, step_s: float
    ) -> None:
        """A decode step of ``batch`` requests over ``tokens`` KV tokens took ``step_s``."""

    def on_request_finished(
        self, request_id: str, now: float, output_tokens: int | None = None
    ) -> None:
        """Finished, aborted or refused by a worker: the request leaves every queue
        (``output_tokens``: how many it generated, when it completed)."""
