"""Chaos against a whole cluster of real processes (chaos_harness.py): SIGKILL and restart of
the prefill worker, the pool service, the router and the decode worker under a steady stream of
greedy shared-prefix requests, with KV layer messages dropped, corrupted and delayed and the
SSD tier's disk full; CURVE keys on every ZeroMQ socket.

Every scenario is ``slow`` (the short one too: on a 2-core Zen 3 EPYC the suite ran past CI's
25 minutes), ``-m chaos`` selects them (and ``python tests/chaos/chaos_harness.py --duration 600``
by hand).
Asserts: every request completed with the clean run's text or ended with a clear error (an HTTP
error naming its reason, or the connection closed or refused while the router was down); none
passed its deadline; afterwards the cluster serves every prompt again identically, every
worker's KV blocks, staging and transfers and the pool's leases and reservations are back to
0, every process stayed under its memory bound, and nothing is left running."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from chaos_harness import ChaosConfig, describe, lost_line, outcome_line, problems, run_scenario
from chaos_harness import summary_counts as counts

from engine.ipc.curve import generate_keys

pytestmark = pytest.mark.chaos


def _check(s: dict) -> None:
    bad = problems(s)
    assert not bad, "\n".join(bad)


def _run(tmp_path: Path, name: str, cfg: ChaosConfig) -> dict:
    from reliab_record import write_record

    keys = str(tmp_path / "keys")
    generate_keys(keys)
    t0 = time.monotonic()
    s = run_scenario(tmp_path, keys, cfg)
    print(s)
    _check(s)
    write_record("chaos", name, describe(cfg), counts(s), outcome_line(s), lost_line(s),
                 time.monotonic() - t0, extra={"summary": s})  # fmt: skip
    return s


@pytest.mark.slow  # CI time on a 2-core Zen 3 EPYC: `pytest -m slow`
def test_chaos_short(tmp_path):
    """One kill of each component (prefill first: its restart turns the KV faults on)."""
    _run(tmp_path, "short", ChaosConfig(duration_s=30.0, kill_interval_s=(2.0, 4.0)))


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_chaos_long(tmp_path, seed):
    duration = float(os.environ.get("CHAOS_DURATION_S", "240"))
    _run(tmp_path, f"long-seed{seed}", ChaosConfig(duration_s=duration, seed=seed, clients=3))
