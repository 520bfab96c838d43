"""Scheduler and KV manager without a model: steps are simulated (each sampled step appends a
token), so these tests cover budgets, chunking, prefix hits, preemption and abort exactly."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import SchedulerConfig
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.kvcache.kv_cache_manager import KVCacheManager
from engine.sampling_params import SamplingParams


def make(rid, prompt, max_tokens=4):
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), detokenizer=None)


def sim_step(sched: Scheduler, finished: list[str]) -> list:
    out = sched.schedule()
    sampling = [s.request for s in out.scheduled if s.samples]
    sched.update_after_step(out)
    for req in sampling:
        req.append_token(7)
        if req.num_output_tokens >= req.params.max_tokens:
            sched.finish(req, "length")
            finished.append(req.request_id)
    sched.kv.check_integrity()
    return out.scheduled


def run(sched, finished, limit=1000):
    for _ in range(limit):
        if not sched.has_work:
            return
        sim_step(sched, finished)
    raise AssertionError("scheduler did not finish")


def test_token_budget_and_chunked_prefill():
    kv = KVCacheManager(64, 16)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=40, max_num_seqs=8), kv)
    sched.add_request(make("a", list(range(100))))
    first = sched.schedule()
    assert [(s.request.request_id, s.num_tokens) for s in first.scheduled] == [("a", 40)]
    assert not first.scheduled[0].samples
    sched.update_after_step(first)
    sched.add_request(make("b", list(range(200, 210))))
    second = sched.schedule()
    # Running chunk first, then the new prompt in what is left of the budget.
    assert [(s.request.request_id, s.num_tokens) for s in second.scheduled] == [("a", 40)]
    sched.update_after_step(second)
    third = sched.schedule()
    assert [(s.request.request_id, s.num_tokens) for s in third.scheduled] == [("a", 20), ("b", 10)]
    assert all(s.samples for s in third.scheduled)


def test_prefix_hit_skips_cached_blocks():
    kv = KVCacheManager(64, 16)
    sched = Scheduler(SchedulerConfig().for_device("cpu"), kv)
    shared = list(range(64))
    done = []
    sched.add_request(make("a", shared + [1000, 1001], max_tokens=1))
    run(sched, done)
    sched.add_request(make("b", shared + [2000, 2001, 2002], max_tokens=1))
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.request.metrics.num_cached_tokens == 64
    assert s.num_tokens == 3  # only the unshared tail is computed
    assert kv.prefix_hits == 64


def test_fully_cached_prompt_still_computes_last_token():
    kv = KVCacheManager(64, 16)
    sched = Scheduler(SchedulerConfig().for_device("cpu"), kv)
    done = []
    sched.add_request(make("a", list(range(32)), max_tokens=1))
    run(sched, done)
    sched.add_request(make("b", list(range(32)), max_tokens=1))
    (s,) = sched.schedule().scheduled
    assert s.request.num_computed_tokens == 16 and s.num_tokens == 16


def test_preemption_under_tiny_budget_finishes_everything():
    kv = KVCacheManager(6, 4)  # 24 token slots for 3 requests of up to 12 tokens
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv)
    for i in range(3):
        sched.add_request(make(f"r{i}", list(range(i * 10, i * 10 + 6)), max_tokens=6))
    done = []
    run(sched, done)
    assert sorted(done) == ["r0", "r1", "r2"]
    assert sched.num_preemptions > 0
    assert kv.pool.check_integrity().used == 0


def test_admission_leaves_a_watermark_for_running_requests():
    kv = KVCacheManager(10, 4)
    sched = Scheduler(SchedulerConfig().for_device("cpu"), kv)
    assert sched.watermark_blocks == 1
    sched.add_request(make("a", list(range(8)), max_tokens=8))  # 2 blocks
    sim_step(sched, [])
    sched.add_request(make("b", list(range(100, 132)), max_tokens=1))  # needs all 8 free blocks
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["a"]  # b waits: no room to grow
    sched.update_after_step(out)
    # Alone, a request may use every block.
    kv2 = KVCacheManager(8, 4)
    sched2 = Scheduler(SchedulerConfig().for_device("cpu"), kv2)
    sched2.add_request(make("b", list(range(100, 132)), max_tokens=1))
    assert [s.num_tokens for s in sched2.schedule().scheduled] == [32]


def test_abort_frees_every_block():
    kv = KVCacheManager(32, 4)
    sched = Scheduler(SchedulerConfig().for_device("cpu"), kv)
    reqs = [make(f"r{i}", list(range(i, i + 9)), max_tokens=50) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    done = []
    sim_step(sched, done)
    sim_step(sched, done)
    for r in reqs:
        sched.finish(r, "abort")
    counts = kv.pool.check_integrity()
    assert counts.used == 0 and not kv.block_tables and not sched.has_work


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["add", "abort", "step"]), st.integers(0, 10**6)), max_size=60
    )
)
def test_random_add_abort_step_keeps_integrity(ops):
    kv = KVCacheManager(12, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=4), kv)
    rng = random.Random(0)
    added, finished, aborted = [], [], []
    for op, x in ops:
        if op == "add":
            rid = f"r{len(added)}"
            # Shared prefixes on purpose, to exercise prefix hits and shared blocks.
            prompt = [x % 3] * (x % 5) + [rng.randrange(50) for _ in range(1 + x % 17)]
            sched.add_request(make(rid, prompt, max_tokens=1 + x % 6))
            added.append(rid)
        elif op == "abort" and sched.requests:
            rid = sorted(sched.requests)[x % len(sched.requests)]
            sched.finish(sched.requests[rid], "abort")
            aborted.append(rid)
        else:
            sim_step(sched, finished)
        kv.check_integrity()
        live = [r.request_id for r in list(sched.waiting) + sched.running]
        assert len(live) == len(set(live)) == len(sched.requests)
    run(sched, finished)
    assert sorted(finished + aborted) == sorted(added)  # nothing lost, nothing twice
    assert kv.pool.check_integrity().used == 0


# -- pipeline stages: ready_tokens, prefix_tokens / prefix_exact, prefill_only --------------


def cached_prefix(sched: Scheduler, prompt: list[int]) -> None:
    """Run ``prompt`` to the end once, so that its full blocks are in the prefix cache."""
    done: list[str] = []
    sched.add_request(make("warm", prompt, max_tokens=1))
    run(sched, done)


def test_prefix_tokens_caps_the_hit_to_whole_blocks():
    kv = KVCacheManager(32, 16)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=4), kv)
    prompt = list(range(80))
    cached_prefix(sched, prompt)
    req = make("r", prompt)
    req.prefix_tokens = 40  # floored to 32
    sched.add_request(req)
    (s,) = sched.schedule().scheduled
    assert req.num_computed_tokens == 32 and s.num_tokens == 48
    assert req.metrics.num_cached_tokens == 32


def test_prefix_exact_is_checked_again_after_a_preemption():
    kv = KVCacheManager(32, 16)
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4), kv, prefill_only=True
    )
    prompt = list(range(64))
    cached_prefix(sched, prompt)
    req = make("r", prompt)
    req.prefix_tokens, req.prefix_exact, req.ready_tokens = 32, True, 48
    sched.add_request(req)
    out = sched.schedule()
    assert [(s.request, s.num_tokens) for s in out.scheduled] == [(req, 16)]
    sched.update_after_step(out)
    assert req.num_computed_tokens == 48
    assert sched.schedule().empty  # running, nothing ready: skipped
    sched._preempt(req)
    kv.pool.evict_all_cached()  # the prefix it must start at is gone
    out = sched.schedule()
    assert out.empty and out.ended == [req]
    assert req.finish_reason == "abort" and req.stop_reason == "prefix_missing"
    assert not kv.block_tables and kv.pool.num_free == kv.num_blocks
    kv.check_integrity()


def test_prefill_only_never_schedules_past_the_prompt():
    kv = KVCacheManager(8, 16)
    sched = Scheduler(SchedulerConfig().for_device("cpu"), kv, prefill_only=True)
    req = make("r", list(range(20)))
    sched.add_request(req)
    out = sched.schedule()
    sched.update_after_step(out)
    req.append_token(7)  # the last stage sampled the first token
    assert sched.schedule().empty and req in sched.running
    sched.finish(req, "handed_over")
    assert kv.pool.num_free == kv.num_blocks


def test_a_waiting_request_with_nothing_ready_does_not_hold_up_the_queue():
    kv = KVCacheManager(16, 16)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv, prefill_only=True)
    stuck, ready = make("stuck", list(range(40))), make("ready", list(range(100, 120)))
    stuck.ready_tokens = 0
    sched.add_request(stuck)
    sched.add_request(ready)
    out = sched.schedule()
    assert [(s.request, s.num_tokens) for s in out.scheduled] == [(ready, 20)]
    assert list(sched.waiting) == [stuck] and "stuck" not in kv.block_tables
    sched.update_after_step(out)
    stuck.ready_tokens = 24
    (s,) = sched.schedule().scheduled
    assert (s.request, s.num_tokens) == (stuck, 24)


def test_step_budget_defaults_per_device_and_the_scheduler_takes_a_number():
    from engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS

    unset = SchedulerConfig()
    assert unset.max_num_batched_tokens is None
    assert unset.for_device("cpu").max_num_batched_tokens == 1024
    assert unset.for_device("cuda").max_num_batched_tokens == 2048
    assert DEFAULT_MAX_NUM_BATCHED_TOKENS == {"cpu": 1024, "cuda": 2048}
    mine = SchedulerConfig(max_num_batched_tokens=300)
    assert mine.for_device("cpu") is mine and mine.for_device("cuda") is mine
    with pytest.raises(ValueError, match="max_num_batched_tokens: no default for device type"):
        unset.for_device("mps")
    with pytest.raises(ValueError, match="max_num_batched_tokens must be > 0"):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens: the Scheduler takes a number"):
        Scheduler(unset, KVCacheManager(8, 4))


def test_drafts_ride_with_a_decode_within_the_budget_and_only_kept_ones_commit():
    kv = KVCacheManager(32, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=6, max_num_seqs=8), kv)
    req = make("a", [1, 2, 3, 4, 5], max_tokens=20)
    sched.add_request(req)
    sim_step(sched, [])  # the prompt, and its first token
    assert (req.num_computed_tokens, req.num_tokens) == (5, 6)
    req.spec_token_ids = [9, 9, 9, 9, 9, 9, 9]
    out = sched.schedule()
    (s,) = out.scheduled
    assert s.spec_tokens == [9] * 5 and s.num_tokens == 6  # cut to the step's budget
    assert s.num_real_tokens == 1 and s.samples
    assert len(kv.block_tables["a"]) == 3  # room for positions 5..10
    sched.update_after_step(out)
    assert req.num_computed_tokens == 6  # the drafts are not computed yet
    for t in (9, 9, 4):  # two drafts kept, then the model's own token
        req.append_token(t)
    assert sched.commit_drafts(req) == 2
    assert req.num_computed_tokens == 8 and req.num_tokens == 9
    assert len(kv.block_tables["a"]) == 3  # positions 0..8 need all three blocks
    # The blocks whose tokens are all computed are named by the tokens really output.
    assert kv._num_cached_blocks["a"] == 2
    req.spec_token_ids = [1, 1, 1, 1, 1]
    out = sched.schedule()
    sched.update_after_step(out)
    req.append_token(3)  # none kept: the blocks past the next token's are freed
    assert sched.commit_drafts(req) == 0
    assert len(kv.block_tables["a"]) == 3
    kv.check_integrity()
    sched.finish(req, "abort")
    assert kv.pool.num_free == kv.num_blocks


def test_a_preempted_request_loses_its_drafts():
    kv = KVCacheManager(8, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), kv)
    a, b = make("a", list(range(10)), 8), make("b", list(range(12)), 8)
    sched.add_request(a)
    sched.add_request(b)
    sim_step(sched, [])
    a.spec_token_ids = b.spec_token_ids = [5] * 6
    out = sched.schedule()  # 32 slots: both cannot grow by 7 tokens
    assert out.preempted and out.preempted[0].spec_token_ids == []
