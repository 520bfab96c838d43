"""docs/reproduction.md lists a simulate.py command per run: each must rebuild that run's config."""

from __future__ import annotations

import math

import pytest

from engine.sim import experiments, simulate
from engine.sim.simulator import SimConfig

INF = math.inf


@pytest.mark.parametrize(
    "cfg, speed, duration",
    [
        (SimConfig(policy="random", rejection="none", ttft_slo_s=INF, tbt_slo_s=INF), 1.0, 0.0),
        (
            SimConfig(rejection="none", ttft_slo_s=INF, tbt_slo_s=INF, balancing_threshold=4.0),
            1.0,
            0.0,
        ),
        (SimConfig(prefill=8, decode=1, rejection="early"), 2.0, 0.0),
        (SimConfig(prefill=8, decode=1, oracle_output=True), 2.0, 0.0),
        (SimConfig(colocated=16, rejection="none", ttft_slo_s=INF, tbt_slo_s=INF), 0.25, 1200.0),
    ],
)
def test_documented_commands_rebuild_the_runs(cfg, speed, duration):
    cmd = experiments.command(cfg, speed, duration)
    argv = cmd.split()[2:]  # after "python profiling/simulate.py"
    args = simulate.parse_args(argv)
    assert simulate.config_from(args) == cfg
    assert args.speed == speed and args.duration == duration and args.json


def test_capacity_interpolates_where_the_share_crosses():
    assert experiments.capacity({0.5: 1.0, 1.0: 0.95, 2.0: 0.85}) == pytest.approx(1.5)
    assert experiments.capacity({0.5: 0.5, 1.0: 0.2}) == 0.0  # never meets it
    assert experiments.capacity({0.5: 0.99, 1.0: 0.98}) == 1.0  # meets it at every speed


def test_documented_long_prompt_commands_rebuild_the_runs():
    cfg = SimConfig(prefill=0, prefill_groups=1, stages=8, decode=1, rejection="none",
                    ttft_slo_s=INF, chunk_tokens=2048)  # fmt: skip
    cmd = experiments.command(cfg, 1.0, 0.0, experiments.LONG_LENGTHS)
    args = simulate.parse_args(cmd.split()[2:])
    assert simulate.config_from(args) == cfg
    assert simulate.parse_lengths(args.long_prompts) == list(experiments.LONG_LENGTHS)
