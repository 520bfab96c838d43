"""The Conductor behind the router's one-call Placement interface."""

from __future__ import annotations

from typing import NamedTuple

import pytest

from engine.cluster.conductor.adapter import ConductorPlacement
from engine.cluster.conductor.conductor import Conductor, ConductorConfig
from engine.cluster.conductor.decision import REJECT_TTFT
from engine.kvcache.prefix_hash import hash_blocks


class WorkerView(NamedTuple):  # the fields of engine.cluster.placement.WorkerView
    worker_id: str
    role: str
    host: str
    running: int
    waiting: int
    kv_usage: float


def views(role: str, *ids: str) -> list[WorkerView]:
    return [WorkerView(i, role, "h", 0, 0, 0.0) for i in ids]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def adapter(**cfg) -> tuple[ConductorPlacement, Clock]:
    clock = Clock()
    c = Conductor(ConductorConfig(block_tokens=16, **cfg))
    return ConductorPlacement(c, block_size=16, clock=clock), clock


def test_places_on_the_worker_holding_the_prefix_by_its_published_events():
    pl, _ = adapter(policy="cache_aware")
    prompt = list(range(4000))
    pf, dc = views("prefill", "p0", "p1", "p2"), views("decode", "d0")
    assert pl.place(prompt[:10], pf, dc) is not None  # registers the workers
    keys = hash_blocks(prompt, 16)
    assert pl.on_event("p2", {"type": "stored", "namespace": "ab", "keys": keys, "source": "p2"})
    assert pl.place(prompt, pf, dc) == ("p2", "d0")
    assert pl.last_decision.prefix_blocks == len(keys)


def test_membership_follows_the_live_workers():
    pl, _ = adapter(policy="round_robin")
    assert pl.place([1] * 40, views("prefill", "p0"), views("decode", "d0")) == ("p0", "d0")
    got = pl.place([2] * 40, views("prefill", "p1"), views("decode", "d1"))
    assert got == ("p1", "d1")  # p0 and d0 are gone, p1 and d1 are new


def test_estimated_lifecycle_drains_the_queues():
    pl, clock = adapter(policy="load", decode_time_s=5.0)
    pf, dc = views("prefill", "p0"), views("decode", "d0")
    for i in range(10):
        assert pl.place(list(range(i, i + 3000)), pf, dc) is not None
    c = pl.conductor
    assert c.prefill_queue_s("p0", 0.0) > 0 and c.placed() == 10
    clock.t = 1000.0
    pl.place([7] * 20, pf, dc)
    assert c.placed() == 1  # the ten are done by estimate; only the new one remains
    clock.t = 2000.0
    pl.place([8] * 20, pf, dc)
    assert c.placed() == 1


def test_rejection_returns_none_with_the_reason():
    pl, _ = adapter(policy="load", ttft_slo_s=1e-6)
    assert pl.place(list(range(5000)), views("prefill", "p0"), views("decode", "d0")) is None
    assert pl.last_decision.reason == REJECT_TTFT
    assert pl.place([1], [], views("decode", "d0")) is None


def test_block_size_must_match_the_conductors():
    with pytest.raises(ValueError, match="block_size"):
        ConductorPlacement(Conductor(ConductorConfig(block_tokens=512)), block_size=16)
