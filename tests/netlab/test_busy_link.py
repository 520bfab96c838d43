"""Control traffic on a busy link (slow): ``profiling/bench_busy_link.py`` as its docstring runs
it, shorter: a cluster in the network lab whose prefill and decode hosts have 100 Mbit/s links,
filled by KV transfers of long prompts over TCP. The link must really have been busy (else this
shows nothing), every request completes, no worker is declared dead, and each worker's longest
gap between heartbeats at the router stays below the heartbeat timeout: heartbeats queued
behind KV do not read as a death. Skipped, saying why, where no lab can be made (not root)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.netlab import unavailable

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(unavailable()), reason=str(unavailable())),
]
REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 5.0


def test_heartbeats_keep_time_on_a_link_busy_with_kv(tmp_path):
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "profiling/bench_busy_link.py", "--rate", "100mbit", "--seconds",
           "20", "--idle", "3", "--heartbeat-timeout", str(TIMEOUT_S), "--json", str(out),
           "--logs", str(tmp_path / "logs")]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    idle, busy = json.loads(out.read_text())
    assert busy["rx_bytes"] * 8 / busy["seconds"] > 0.3 * 100e6, done.stdout  # KV filled it
    assert busy["done"] > 0 and busy["failed"] == 0, busy["errors"]
    for phase in (idle, busy):
        for wid, w in phase["health"]["workers"].items():
            assert w["state"] == "up", (wid, w)
            assert 0 < w["heartbeat_gap_max_s"] < TIMEOUT_S, (wid, w)
