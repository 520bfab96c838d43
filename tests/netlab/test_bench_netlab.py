"""``profiling/bench_cluster.py --netlab``: the transfer and overlap tables between two hosts of
the network lab, at a small rate, tiny sizes and one round (the figures themselves are for a
real run; here every row is there, its numbers parse, and the lab is gone after). Skips, saying
why, where no lab can be made (not root)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from engine.netlab import unavailable

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=str(unavailable()))

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "profiling", "bench_cluster.py")


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _row(out: str, start: str) -> list[float]:
    """The first five numbers of the table row that starts with ``start``."""
    line = next((x for x in out.splitlines() if x.startswith(start)), None)
    assert line is not None, f"no row {start!r} in:\n{out}"
    return [float(x) for x in re.findall(r"-?\d+\.\d+", line[len(start) :])][:5]


@pytest.mark.slow  # CI time on a 2-core Zen 3 EPYC: `pytest -m slow`
def test_netlab_transfer_and_overlap_tables():
    argv = [
        sys.executable, SCRIPT, "--netlab", "200mbit", "--transfer-tokens", "64",
        "--rounds", "1", "--overlap-sizes", "64", "--repeats", "1",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("ENGINE_CURVE_KEYS", None)
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, out + err[-3000:]
    assert "ZeroMQ CURVE (raw ZeroMQ and ours alike): off" in out
    assert "## KV transfer between two hosts over a 200mbit link: 64 tokens" in out
    raw = _row(out, "raw ZeroMQ TCP (two processes)")
    ours = _row(out, "KV transfer over tcp (ours)")
    # Gbit/s, best, ratio, send cores, receive cores; a link of 0.2 Gbit/s can't be beaten.
    assert len(raw) == len(ours) == 5 and 0 < raw[0] <= 0.25 and 0 < ours[0] <= 0.25, out
    assert raw[2] == 1.0 and ours[2] > 0
    if "(mooncake skipped" not in out:
        assert len(_row(out, "KV transfer over mooncake (ours)")) == 5
    assert "## Overlap over a 200mbit link" in out
    line = next(x for x in out.splitlines() if re.match(r"^\s+64\s+tcp\s", x))
    assert len(line.split()) == 13, line  # tokens, transport, MiB, 4 times, 2 ratios, 3 CPU, 1
    left = [n for n in _netns() if n.startswith(f"enl{proc.pid}-")]  # other labs may run
    assert not left, f"the lab's namespaces outlived the script: {left}"
