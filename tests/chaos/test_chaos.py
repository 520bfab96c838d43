"""Chaos against a whole cluster of real processes (chaos_harness.py): SIGKILL and restart of
the prefill worker, the pool service, the router and the decode worker under a steady stream of
greedy shared-prefix requests, with KV layer messages dropped, corrupted and delayed and the
SSD tier's disk full; CURVE keys on every ZeroMQ socket.

The short scenario runs in CI on every submission (about 1.5 minutes) with a seed of its own,
printed and named in any failure, so that a failure can be replayed: ``CHAOS_SEED=N pytest
tests/chaos/test_chaos.py::test_chaos_short``. The long ones are ``slow``; ``-m chaos`` selects
them all (and ``python tests/chaos/chaos_harness.py --duration 600`` by hand).
Asserts: every request completed with the clean run's text or ended with a clear error (an HTTP
error naming its reason, or the connection closed or refused while the router was down); none
passed its deadline; afterwards the cluster serves every prompt again identically, every
worker's KV blocks, staging and transfers and the pool's leases and reservations are back to
0, every process stayed under its memory bound, and nothing is left running."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
from chaos_harness import ChaosConfig, describe, lost_line, outcome_line, problems, run_scenario
from chaos_harness import summary_counts as counts

from engine.ipc.curve import generate_keys

pytestmark = pytest.mark.chaos


def _seed() -> int:
    """CHAOS_SEED, or a new one per run (CI then tries another schedule of kills and faults
    on every submission)."""
    raw = os.environ.get("CHAOS_SEED")
    return int(raw) if raw else random.SystemRandom().randrange(1, 10**6)


def _run(tmp_path: Path, name: str, cfg: ChaosConfig) -> dict:
    from reliab_record import write_record

    keys = str(tmp_path / "keys")
    generate_keys(keys)
    t0 = time.monotonic()
    print(f"chaos {name}: seed {cfg.seed} (replay with CHAOS_SEED={cfg.seed})")
    s = run_scenario(tmp_path, keys, cfg)
    print(s)
    bad = problems(s)
    assert not bad, f"seed {cfg.seed} (replay with CHAOS_SEED={cfg.seed}):\n" + "\n".join(bad)
    write_record("chaos", name, describe(cfg), counts(s), outcome_line(s), lost_line(s),
                 time.monotonic() - t0, extra={"summary": s})  # fmt: skip
    return s


def test_chaos_short(tmp_path):
    """One kill of each component (prefill first: its restart turns the KV faults on), on a
    seed of this run's."""
    cfg = ChaosConfig(duration_s=30.0, kill_interval_s=(2.0, 4.0), seed=_seed())
    _run(tmp_path, "short", cfg)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_chaos_long(tmp_path, seed):
    duration = float(os.environ.get("CHAOS_DURATION_S", "240"))
    _run(tmp_path, f"long-seed{seed}", ChaosConfig(duration_s=duration, seed=seed, clients=3))


@pytest.mark.slow
def test_chaos_trace(tmp_path):
    """The conversation trace at its real scale through the cluster under kills and KV faults
    (trace_chaos.py; by hand for 30 minutes: ``python tests/chaos/trace_chaos.py``): every
    answer the same as a colocated engine's."""
    from dataclasses import replace

    from reliab_record import write_record
    from trace_chaos import CONVERSATIONS, TRACE_CONFIG, describe_trace, run_trace_scenario

    duration = float(os.environ.get("CHAOS_DURATION_S", "240"))
    cfg = replace(TRACE_CONFIG, duration_s=duration, seed=_seed())
    keys = str(tmp_path / "keys")
    generate_keys(keys)
    t0 = time.monotonic()
    print(f"chaos trace: seed {cfg.seed} (replay with CHAOS_SEED={cfg.seed})")
    s = run_trace_scenario(tmp_path, keys, cfg, CONVERSATIONS)
    print(s)
    bad = problems(s)
    assert not bad, f"seed {cfg.seed} (replay with CHAOS_SEED={cfg.seed}):\n" + "\n".join(bad)
    write_record("chaos", f"trace-seed{cfg.seed}", describe_trace(cfg, s), counts(s),
                 outcome_line(s), lost_line(s), time.monotonic() - t0,
                 extra={"summary": s})  # fmt: skip
