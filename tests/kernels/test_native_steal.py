"""The C kernels' work split (kernels/native/steal.h): every thread owns a contiguous range of
blocks and takes the others' from their tails once its own is done. Under OMP_THREAD_LIMIT=1
OpenMP gives a team of one while the kernels split the work for the threads torch asks for, so
that one thread must take every other range whole: the results must be the same bits as with a
full team, every row written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.kernels import native

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")

# Run in a child process with OMP_THREAD_LIMIT=1: torch.set_num_threads(argv[2]) sets the
# threads the kernels split for; the team OpenMP forms is one thread.
RUN = """
import sys
import torch
sys.path[:0] = [{tests!r}, {kernels!r}]
torch.set_num_threads(int(sys.argv[2]))
from steal_cases import compute
torch.save(compute(), sys.argv[1])
"""


def run_with_a_team_of_one(tmp_path, threads: int) -> dict:
    path = tmp_path / f"out-{threads}.pt"
    env = {**os.environ, "OMP_THREAD_LIMIT": "1", "PYTHONPATH": str(REPO)}
    code = RUN.format(tests=str(REPO / "tests"), kernels=str(REPO / "tests" / "kernels"))
    done = subprocess.run([sys.executable, "-c", code, str(path), str(threads)], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(path)


# 4 threads: 4 ranges of a few blocks each; 100: more than steal.h's 64 ranges, so most of the
# default model's-sized matrices' ranges hold one block and the small ones' are empty.
@pytest.mark.parametrize("threads", [4, 100])
def test_one_thread_takes_every_range_and_gets_the_same_bits(tmp_path, threads):
    from steal_cases import compute

    mine = compute()
    theirs = run_with_a_team_of_one(tmp_path, threads)
    assert mine.keys() == theirs.keys()
    for name, value in mine.items():
        assert not torch.isnan(theirs[name]).any(), f"{name}: a row was never written"
        assert torch.equal(value, theirs[name]), name
