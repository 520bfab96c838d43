"""The simulated instances' state (engine/sim/simulator.py drives them through its events).

- ``SimCache``: a prefix cache of so many blocks under one of the block store's eviction policies
  (``engine.kvstore.eviction``), keyed by the trace's block ids;
- ``SimRequest``: a trace request on its way through the cluster (its decision, its first token's
  time, the tokens its prefill found cached and the compute it took, its first decode step);
- ``SimPrefill``: a prefill instance, or a group of pipelined stages, with its queue;
- ``SimDecode``: a decode instance (a colocated one also prefills: its cache, queue and the
  request it is prefilling), with its batch, the KV it holds and reserves, and its steps.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from engine.cluster.conductor.pipeline import SINGLE, PipelineShape
from engine.kvstore.eviction import make_policy
from engine.sim.trace import TraceRequest


class SimCache:
    """A prefix cache of ``capacity`` blocks under an eviction policy (keys: the trace's ids)."""

    def __init__(self, capacity: int, eviction: str) -> None:
        self.capacity = capacity
        self.policy = make_policy(eviction)

    def match(self, keys) -> int:
        n = 0
        for k in keys:
            if k not in self.policy:
                break
            n += 1
        return n

    def touch(self, keys) -> None:
        for k in keys:
            self.policy.on_access(k)

    def insert(self, keys, pinned) -> tuple[list, list]:
        """Insert keys (a present key is refreshed); returns (new keys, evicted keys)."""
        new, evicted = [], []
        if self.capacity == 0:
            return new, evicted
        pol = self.policy
        for pos, k in enumerate(keys):
            if k in pol:
                pol.on_access(k)
                continue
            while len(pol) >= self.capacity:
                victim = pol.victim(pinned)
                if victim is None:
                    return new, evicted
                pol.on_remove(victim)
                evicted.append(victim)
            pol.on_insert(k, pos)
            new.append(k)
        return new, evicted


class SimRequest:
    __slots__ = ("tr", "rid", "decision", "t_first", "cached", "compute_s", "first_step", "done")

    def __init__(self, tr: TraceRequest) -> None:
        self.tr = tr
        self.rid = str(tr.index)
        self.decision = None
        self.t_first = math.nan
        self.cached = 0
        self.compute_s = 0.0
        self.first_step = 0
        self.done = False


@dataclass
class SimPrefill:
    """A prefill instance, or a group (its stages share one view of the cached blocks, as the
    group reports the prefix all its stages hold)."""

    name: str
    cache: SimCache
    queue: deque = field(default_factory=deque)
    job: SimRequest | None = None  # the request entering it (a group: still on its first stage)
    shape: PipelineShape = SINGLE
    free: list[float] = field(default_factory=list)  # a group: when each stage is next idle


@dataclass
class SimDecode:
    name: str
    capacity: int
    max_batch: int
    running: int = 0
    ctx: int = 0  # KV tokens held
    reserved: int = 0  # KV tokens reserved (prompt + output of every running request)
    step: int = 0  # index of the next step to end
    ends: list = field(default_factory=list)  # end time of each step
    finishing: list = field(default_factory=list)  # heap (last step, seq, request)
    waiting: deque = field(default_factory=deque)
    stepping: bool = False
    last_step_s: float = 0.0
    # colocated instances also prefill
    cache: SimCache | None = None
    queue: deque = field(default_factory=deque)
    prefilling: SimRequest | None = None
