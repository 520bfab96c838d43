"""A cluster's draft counters are its workers' added up, position by position; none: {}."""

from __future__ import annotations

from engine.spec.stats import SpecStats, sum_spec_stats


def test_workers_counters_add_up():
    a = SpecStats(2, 10, 6, [2, 2, 1, 1]).snapshot()
    b = SpecStats(1, 3, 1, [1, 0]).snapshot()
    assert sum_spec_stats([a, {}, b]) == {
        "verifications": 3,
        "proposed": 13,
        "accepted": 7,
        "accepted_per_position": [3, 2, 1, 1],
    }
    assert sum_spec_stats([{}, {}]) == {}
