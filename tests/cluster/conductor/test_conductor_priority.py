"""The Conductor under the priority scheduling policy: its prefill queues in (priority, arrival)
order behind their heads (prefill_queue.py), TTFT estimated on the part of a queue a request
waits for, and a verdict monotone in priority: at one moment, for one prompt, a request is never
rejected while one of a lower priority (a larger value) would be admitted."""

from __future__ import annotations

import copy
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_conductor import BT, keys

from engine.cluster.conductor.conductor import Conductor, ConductorConfig
from engine.cluster.conductor.cost_model import PAPER
from engine.cluster.conductor.decision import REJECT_TTFT
from engine.cluster.conductor.prefill_queue import PrefillQueue


def test_the_queue_keeps_priority_order_behind_its_head():
    q = PrefillQueue("A")
    assert q.push("head", 10.0, 0.0, priority=9) == []
    assert q.push("low", 4.0, 0.0, priority=5) == []
    assert q.push("mid", 3.0, 0.0, priority=1) == ["low"]  # it goes ahead of low
    assert q.push("mid2", 2.0, 0.0, priority=1) == ["low"]  # after its equal
    assert q.push("top", 1.0, 0.0, priority=-1) == ["mid", "mid2", "low"]
    assert list(q.queue) == ["head", "top", "mid", "mid2", "low"]
    # At t=4 the head has 6 s left; a newcomer waits for it and for what it does not go ahead of.
    assert q.queue_s(4.0, priority=-5) == pytest.approx(6.0)
    assert q.queue_s(4.0, priority=1) == pytest.approx(6.0 + 1 + 3 + 2)
    assert q.queue_s(4.0, priority=7) == pytest.approx(6.0 + 1 + 3 + 2 + 4)
    assert q.queue_s(4.0) == pytest.approx(q.queued_s - 4.0)  # fcfs: everything
    q.pop("head", 10.0)  # the next in service order heads the queue from now
    assert next(iter(q.queue)) == "top" and q.queue_s(10.5, priority=1) == pytest.approx(5.5)


def test_fcfs_queue_is_arrival_order_whatever_is_asked():
    q = PrefillQueue("A")
    for i, rid in enumerate(("a", "b", "c")):
        assert q.push(rid, 1.0 + i, 0.0) == []
    assert list(q.queue) == ["a", "b", "c"] and q.queue_s(0.0) == pytest.approx(6.0)


def cluster(policy="priority", rejection="none", slo=30.0, prefills=("A",)) -> Conductor:
    c = Conductor(
        ConductorConfig(
            policy="kvcentric", rejection=rejection, ttft_slo_s=slo, scheduling_policy=policy
        )
    )
    c.add_instance("D", "decode", kv_capacity_tokens=PAPER.decode_kv_capacity_tokens)
    for p in prefills:
        c.add_instance(p, "prefill")
    return c


PLEN = 8 * BT


def test_a_high_priority_request_waits_only_for_the_head_and_its_betters():
    c = cluster()
    one = c.prefill_model.predict(PLEN, 0)
    for i in range(5):
        assert c.decide(f"low{i}", keys(f"low{i}-", 8), PLEN, 0.0, priority=5).accepted
    high = c.decide("high", keys("high-", 8), PLEN, 0.0, priority=0)
    assert high.est_ttft_s == pytest.approx(2 * one)  # the head's prefill, then its own
    low = c.decide("low5", keys("low5-", 8), PLEN, 0.0, priority=5)
    assert low.est_ttft_s == pytest.approx(7 * one)  # behind every earlier one
    # The lows it went ahead of reach their decode instance one prefill later than placed.
    incoming = c.decode_state("D").incoming
    assert incoming["low1"][1] == pytest.approx(2 * one + one)
    assert incoming["low0"][1] == pytest.approx(one)  # the head: not moved


def test_fcfs_ignores_the_priority():
    c = cluster(policy="fcfs")
    one = c.prefill_model.predict(PLEN, 0)
    for i in range(3):
        c.decide(f"low{i}", keys(f"low{i}-", 8), PLEN, 0.0, priority=5)
    assert c.decide("high", keys("h", 8), PLEN, 0.0, priority=-9).est_ttft_s == pytest.approx(
        4 * one
    )


def test_under_overload_lower_priorities_are_refused_first():
    """TTFT SLO of 4 prefills: the queue fills with priority-5 requests until they are refused;
    a priority-0 request is still admitted then, and priority-5 ones are refused after it."""
    one = cluster().prefill_model.predict(PLEN, 0)
    c = cluster(slo=4.5 * one)
    placed = 0
    while c.decide(f"low{placed}", keys(f"low{placed}-", 8), PLEN, 0.0, priority=5).accepted:
        placed += 1
    assert placed == 4
    refused = c.decide("low-again", keys("x", 8), PLEN, 0.0, priority=5)
    assert not refused.accepted and refused.reason == REJECT_TTFT
    for i in range(3):  # high ones queue behind the head and each other only
        assert c.decide(f"high{i}", keys(f"high{i}-", 8), PLEN, 0.0, priority=0).accepted
    assert not c.decide("low-later", keys("y", 8), PLEN, 0.0, priority=5).accepted
    # Under fcfs the same load refuses everyone alike.
    f = cluster(policy="fcfs", slo=4.5 * one)
    for i in range(4):
        assert f.decide(f"low{i}", keys(f"low{i}-", 8), PLEN, 0.0, priority=5).accepted
    assert not f.decide("high", keys("h", 8), PLEN, 0.0, priority=0).accepted


def loaded(rejection: str, slo_prefills: float, tbt_slo: float) -> Conductor:
    """Two prefill and two decode instances (one with a quarter of the KV), for the property."""
    one = cluster().prefill_model.predict(PLEN, 0)
    c = Conductor(
        ConductorConfig(
            rejection=rejection,
            ttft_slo_s=slo_prefills * one,
            tbt_slo_s=tbt_slo,
            scheduling_policy="priority",
        )
    )
    c.add_instance("D", "decode", kv_capacity_tokens=PAPER.decode_kv_capacity_tokens)
    c.add_instance("E", "decode", kv_capacity_tokens=PAPER.decode_kv_capacity_tokens // 4)
    for p in ("A", "B"):
        c.add_instance(p, "prefill")
    return c


@settings(max_examples=150, deadline=None)
@given(
    rejection=st.sampled_from(["none", "early", "predicted"]),
    placed=st.lists(
        st.tuples(
            st.integers(-3, 3),  # priority
            st.integers(1, 24),  # blocks
            st.sampled_from([0.0, 0.5, 2.0]),  # seconds after the one before
            st.booleans(),  # its prefill is done (it decodes) when the next comes
        ),
        max_size=40,
    ),
    slo_prefills=st.floats(1.0, 30.0),
    tbt_slo=st.floats(0.02, 0.2),
    pair=st.tuples(st.integers(-4, 4), st.integers(-4, 4)),
    blocks=st.integers(1, 24),
)
def test_the_verdict_is_monotone_in_priority(
    rejection, placed, slo_prefills, tbt_slo, pair, blocks
):
    """Whatever was placed before (priorities, lengths, times, prefills done), a request of
    priority p is admitted whenever one of priority q > p would be, at the same moment, for the
    same prompt, by the TTFT and by the decode load (which both see the same decode instance).
    (Without judging the decode side at the arrival-order prefill end, 4 in 1,500 random states
    broke this, and a fifth of the pairs went to different decode instances.)"""
    c = loaded(rejection, slo_prefills, tbt_slo)
    now = 0.0
    for i, (prio, n, dt, done) in enumerate(placed):
        now += dt
        d = c.decide(f"r{i}", keys(f"r{i}-", n), n * BT, now, priority=prio)
        if d.accepted and done:
            c.on_prefill_done(f"r{i}", now)
    better, worse = sorted(pair)
    prompt = keys("new-", blocks)
    hi = copy.deepcopy(c).decide("new", prompt, blocks * BT, now, priority=better)
    lo = copy.deepcopy(c).decide("new", prompt, blocks * BT, now, priority=worse)
    assert hi.accepted or not lo.accepted, (hi, lo)
    assert hi.est_ttft_s <= lo.est_ttft_s or math.isclose(hi.est_ttft_s, lo.est_ttft_s)
    if hi.accepted and lo.accepted:
        assert hi.decode == lo.decode
