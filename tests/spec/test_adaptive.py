"""A sequence's draft budget: up on acceptance, down on rejection, paused (with growing pauses)
at none, and fixed when not adaptive."""

from __future__ import annotations

from engine.spec.adaptive import BUSY_MIN_RATE, MAX_PAUSE, DraftBudget


def test_all_kept_raises_some_kept_sets_none_kept_halves():
    b = DraftBudget(8)
    assert b.allowed() == 8
    b.observe(8, 3)
    assert b.allowed() == 4
    b.observe(4, 4)
    assert b.allowed() == 5
    b.observe(5, 0)
    assert b.allowed() == 2
    b.observe(2, 0)
    assert b.allowed() == 1


def test_misses_at_one_pause_the_sequence_for_longer_each_time():
    b = DraftBudget(4)
    b.observe(4, 0)
    b.observe(2, 0)
    assert b.limit == 1 and b.paused == 0
    b.observe(1, 0)  # pause 1
    assert [b.allowed() for _ in range(2)] == [0, 1]
    b.observe(1, 0)  # pause 2
    assert [b.allowed() for _ in range(3)] == [0, 0, 1]
    for _ in range(20):
        b.observe(1, 0)
    assert b.pause == MAX_PAUSE
    b.paused = 0
    b.observe(1, 1)  # a kept draft ends the doubling
    assert b.pause == 0 and b.allowed() == 2


def test_not_adaptive_keeps_the_maximum():
    b = DraftBudget(5, adaptive=False)
    for _ in range(10):
        b.observe(5, 0)
    assert b.allowed() == 5


def test_a_busy_step_takes_drafts_only_from_sequences_that_keep_most():
    good, poor = DraftBudget(5), DraftBudget(5)
    for _ in range(3):
        good.observe(5, 4)
        poor.observe(5, 1)
    assert good.rate >= BUSY_MIN_RATE > poor.rate
    assert good.allowed(busy=True) == 5 and poor.allowed(busy=True) == 0
    assert poor.allowed(busy=False) == 2  # alone or in a light step it still proposes
    fixed = DraftBudget(5, adaptive=False)
    fixed.observe(5, 0)
    assert fixed.allowed(busy=True) == 5
