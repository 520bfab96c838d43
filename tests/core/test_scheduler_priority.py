"""The scheduling policies without a model (steps simulated as in test_scheduler.py): under
``priority`` the queue is taken by (priority, arrival) and the running request with the largest
(priority, arrival) is preempted first; under ``fcfs`` priorities change nothing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler import run, sim_step

from engine.config import SchedulerConfig
from engine.core.request import Request
from engine.core.scheduler import Scheduler, queue_key
from engine.kvcache.kv_cache_manager import KVCacheManager
from engine.sampling_params import SamplingParams


def make(rid, priority, arrival, prompt_len=4, max_tokens=4):
    return Request(
        rid,
        list(range(prompt_len)),
        SamplingParams(max_tokens=max_tokens),
        detokenizer=None,
        arrival_time=arrival,
        priority=priority,
    )


def scheduler(policy, num_blocks=64, block_size=4, max_num_seqs=8, budget=64):
    kv = KVCacheManager(num_blocks, block_size)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, policy=policy)
    return Scheduler(cfg, kv)


def admission_order(sched) -> list[str]:
    """Run to the end one sequence at a time; the order requests were first scheduled in."""
    order, done = [], []
    while sched.has_work:
        for s in sim_step(sched, done):
            if s.request.request_id not in order:
                order.append(s.request.request_id)
    return order


# (request id, priority, arrival)
ARRIVALS = [("a", 3, 1.0), ("b", 0, 2.0), ("c", 3, 0.5), ("d", -2, 4.0), ("e", 0, 3.0)]


def test_priority_takes_the_queue_by_priority_then_arrival():
    sched = scheduler("priority", max_num_seqs=1)
    for rid, prio, t in ARRIVALS:
        sched.add_request(make(rid, prio, t))
    assert [r.request_id for r in sched.waiting] == ["d", "b", "e", "c", "a"]
    assert admission_order(sched) == ["d", "b", "e", "c", "a"]


def test_fcfs_ignores_priorities_and_keeps_arrival_order():
    sched = scheduler("fcfs", max_num_seqs=1)
    for rid, prio, t in ARRIVALS:
        sched.add_request(make(rid, prio, t))
    assert admission_order(sched) == ["a", "b", "c", "d", "e"]  # as added


def test_a_high_priority_arrival_jumps_the_queue_but_not_the_running_batch():
    sched = scheduler("priority", max_num_seqs=2)
    done: list[str] = []
    for rid, t in (("low1", 1.0), ("low2", 2.0), ("low3", 3.0)):
        sched.add_request(make(rid, 5, t, max_tokens=3))
    sim_step(sched, done)  # low1 and low2 run
    sched.add_request(make("high", 0, 9.0, max_tokens=3))
    assert [r.request_id for r in sched.running] == ["low1", "low2"]  # nothing preempted
    assert [r.request_id for r in sched.waiting] == ["high", "low3"]
    order = []
    while sched.has_work:
        for s in sim_step(sched, done):
            if s.request.request_id not in order:
                order.append(s.request.request_id)
    assert order == ["low1", "low2", "high", "low3"]


def preempted_on_growth(policy, specs) -> list[str]:
    """Three 4-token prompts admitted together into 7 blocks of 4 tokens; each decode step grows
    them until their third blocks do not all fit: who is preempted."""
    sched = scheduler(policy, num_blocks=7, block_size=4)
    for rid, prio, t in specs:
        sched.add_request(make(rid, prio, t, max_tokens=20))
    for _ in range(20):
        out = sched.schedule()
        if out.preempted:
            return [r.request_id for r in out.preempted]
        sampling = [s.request for s in out.scheduled if s.samples]
        sched.update_after_step(out)
        for req in sampling:
            req.append_token(7)
        sched.kv.check_integrity()
    raise AssertionError("nothing was preempted")


@pytest.mark.parametrize(
    "specs, victim",
    [
        # the lowest priority (largest value), though it arrived first
        ([("a", 2, 1.0), ("b", 0, 2.0), ("c", 1, 3.0)], "a"),
        # among equals, the latest arrival
        ([("a", 1, 1.0), ("b", 1, 2.0), ("c", 0, 3.0)], "b"),
        ([("a", 0, 1.0), ("b", 0, 2.0), ("c", 0, 3.0)], "c"),
    ],
)
def test_priority_preempts_the_lowest_priority_latest_arrival_first(specs, victim):
    assert preempted_on_growth("priority", specs) == [victim]


def test_fcfs_preempts_the_newest_admitted_whatever_the_priorities():
    assert preempted_on_growth("fcfs", [("a", 2, 1.0), ("b", 0, 2.0), ("c", 1, 3.0)]) == ["c"]


def test_a_preempted_request_goes_back_to_its_place_by_priority():
    sched = scheduler("priority", num_blocks=7, block_size=4, max_num_seqs=3)
    for rid, prio, t in (("a", 2, 1.0), ("b", 0, 2.0), ("c", 1, 3.0)):
        sched.add_request(make(rid, prio, t, max_tokens=20))
    sim_step(sched, [])
    sched.add_request(make("w1", 1, 4.0))  # they wait: every sequence slot is taken
    sched.add_request(make("w3", 3, 0.0))
    for _ in range(20):
        out = sched.schedule()
        if out.preempted:
            break
        sampling = [s.request for s in out.scheduled if s.samples]
        sched.update_after_step(out)
        for req in sampling:
            req.append_token(7)
    assert [r.request_id for r in out.preempted] == ["a"]
    # a (priority 2) goes behind w1 (priority 1) and before w3 (priority 3).
    assert [r.request_id for r in sched.waiting] == ["w1", "a", "w3"]


def test_the_policy_is_validated_naming_the_field():
    with pytest.raises(ValueError, match=r"policy \(--scheduling-policy\) must be one of fcfs"):
        SchedulerConfig(policy="lifo")


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "step", "abort"]),
            st.integers(-3, 3),  # priority
            st.integers(1, 40),  # prompt length
        ),
        min_size=1,
        max_size=60,
    )
)
def test_random_priority_traffic_keeps_the_queue_ordered_and_finishes(ops):
    sched = scheduler("priority", num_blocks=24, block_size=4, max_num_seqs=4, budget=16)
    done: list[str] = []
    for i, (op, prio, n) in enumerate(ops):
        if op == "add":
            sched.add_request(make(f"r{i}", prio, float(i), prompt_len=n, max_tokens=3))
        elif op == "abort" and sched.requests:
            rid = sorted(sched.requests)[n % len(sched.requests)]
            sched.finish(sched.requests[rid], "abort")
        else:
            sim_step(sched, done)
        keys = [queue_key(r) for r in sched.waiting]
        assert keys == sorted(keys)
    run(sched, done)
    assert not sched.requests and sched.kv.pool.num_free == sched.kv.num_blocks
