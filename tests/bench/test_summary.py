"""engine/bench/summary.py's helpers for benchmarks repeated in rounds (profiling/bench_peer.py
--rounds)."""

from __future__ import annotations

import pytest

from engine.bench.summary import median_over_rounds, round_order


def test_round_order_reverses_every_other_round():
    names = ["llama-server", "engine"]
    assert [round_order(names, i) for i in range(4)] == [
        names,
        names[::-1],
        names,
        names[::-1],
    ]
    assert names == ["llama-server", "engine"]  # not reversed in place


def test_median_over_rounds_takes_each_figure_over_the_rounds_a_system_ran_in():
    rounds = [
        {
            "llama": {"tok_s": 40.0, "ttft": 0.6},
            "engine": {"tok_s": 42.0, "ttft": 0.7},
            "hf": {"tok_s": 9.0, "ttft": 3.0},
        },
        {"engine": {"tok_s": 52.0, "ttft": 0.5}, "llama": {"tok_s": 45.0, "ttft": 0.4}},
        {"llama": {"tok_s": 47.0, "ttft": 0.5}, "engine": {"tok_s": 57.0, "ttft": 0.6}},
    ]
    med = median_over_rounds(rounds)
    assert list(med) == ["llama", "engine", "hf"]
    assert med["llama"] == {"tok_s": 45.0, "ttft": 0.5}
    assert med["engine"] == {"tok_s": 52.0, "ttft": 0.6}
    assert med["hf"] == {"tok_s": 9.0, "ttft": 3.0}  # ran in the first round only


def test_median_over_rounds_refuses_no_rounds():
    with pytest.raises(ValueError, match="no rounds"):
        median_over_rounds([])
