"""The reliability records (tests/reliab_record.py) are written by the session hook of
tests/conftest.py when the whole run passed; otherwise a line says why not, and the test that
held its record still passes (a test never fails because another one did)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

CONFTEST = f"""
import importlib.util, sys
sys.path[:0] = [{str(TESTS.parent)!r}, {str(TESTS)!r}]
spec = importlib.util.spec_from_file_location("suite_conftest", {str(TESTS / "conftest.py")!r})
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
pytest_sessionfinish = suite.pytest_sessionfinish
"""

TESTS_SRC = """
import os

def test_holds_a_record():
    from reliab_record import record_if_the_run_passes

    counts = {"inputs": 3}
    record_if_the_run_passes("fuzz", "demo", "three inputs", counts, "all refused",
                             duration_s=1.234, extra={"k": 1})
    counts["inputs"] = 99  # changed afterwards: the record keeps what it was given

def test_another():
    assert os.environ.get("FAIL_ONE") != "1"
"""


def run(tmp_path: Path, fail: bool) -> tuple[subprocess.CompletedProcess, Path]:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_demo.py").write_text(TESTS_SRC)
    records = tmp_path / "records"
    env = dict(os.environ, ENGINE_RELIABILITY_DIR=str(records), FAIL_ONE="1" if fail else "0")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return done, records


def test_a_failed_run_writes_no_record_and_says_why(tmp_path):
    done, records = run(tmp_path, fail=True)
    assert done.returncode == 1, done.stdout
    assert "1 failed, 1 passed" in done.stdout  # the record's own test passed
    assert "reliability records not written (fuzz-demo): 1 test failed" in done.stdout
    assert not records.exists()


def test_a_passing_run_writes_the_record_as_given(tmp_path):
    done, records = run(tmp_path, fail=False)
    assert done.returncode == 0, done.stdout
    assert "not written" not in done.stdout
    rec = json.loads((records / "fuzz-demo.json").read_text())
    when = rec.pop("when")
    assert len(when) == len("2026-12-01 12:00:00")
    assert rec == {
        "suite": "fuzz",
        "name": "demo",
        "tried": "three inputs",
        "counts": {"inputs": 3},
        "outcome": "all refused",
        "lost": "nothing",
        "duration_s": 1.2,
        "k": 1,
    }
