"""The Conductor's recent decisions (decision_log.py), as the router's placement keeps them for
the dashboard: placements named by the router's id, rejections with their reason, the last
DECISION_LOG_SIZE only, JSON-able (no infinity)."""

from __future__ import annotations

import json

import pytest
from test_conductor_placement import adapter, views

from engine.cluster.conductor.decision import REJECT_NO_PREFILL
from engine.cluster.conductor.decision_log import DECISION_LOG_SIZE, DecisionLog


def test_placements_and_rejections_are_recorded():
    pl, _ = adapter(policy="round_robin")
    assert pl.place([1] * 40, views("prefill", "p0"), views("decode", "d0")) == ("p0", "d0")
    pl.bind("req-a/0")
    assert pl.place([2] * 40, [], views("decode", "d0")) is None  # no prefill worker
    pl.bind("req-b/0")  # a rejection is never bound: the entry keeps its own id
    placed, rejected = pl.recent_decisions()
    assert placed["request_id"] == "req-a/0" and placed["accepted"]
    assert (placed["prefill"], placed["decode"], placed["reason"]) == ("p0", "d0", "")
    assert placed["est_ttft_s"] > 0
    assert not rejected["accepted"] and rejected["reason"] == REJECT_NO_PREFILL
    assert rejected["request_id"] != "req-b/0" and rejected["prefill"] is None
    assert rejected["est_ttft_s"] is None  # an infinite estimate: null in JSON
    json.dumps(pl.recent_decisions(), allow_nan=False)


def test_the_ring_is_bounded_and_oldest_first():
    pl, _ = adapter(policy="round_robin")
    pf, dc = views("prefill", "p0"), views("decode", "d0")
    for i in range(DECISION_LOG_SIZE + 5):
        pl.place([i + 1] * 40, pf, dc)
        pl.bind(f"r{i}")
    ids = [d["request_id"] for d in pl.recent_decisions()]
    assert ids == [f"r{i}" for i in range(5, DECISION_LOG_SIZE + 5)]


def test_size_is_validated():
    with pytest.raises(ValueError, match="size"):
        DecisionLog(0)
