"""profiling/reliability_report.py: docs/reliability.md from the records of this checkout's runs,
keeping the rows of runs recorded elsewhere (other machines, other checkouts) that the report
before held, so a new run adds its row instead of erasing the history."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _report():
    path = ROOT / "profiling/reliability_report.py"
    spec = importlib.util.spec_from_file_location("reliability_report", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rec(name: str, outcome: str) -> dict:
    summary = {"errors": {"503 no live workers": 3}, "timeline": [[1.0, "kill", "prefill"]]}
    return {"suite": "chaos", "name": name, "tried": "kills", "counts": {"requests": 9},
            "outcome": outcome, "lost": "nothing", "duration_s": 60.0, "when": "2026-12-04",
            "summary": summary}  # fmt: skip


def test_rows_of_earlier_runs_are_kept_and_a_new_record_replaces_its_own(tmp_path):
    rr = _report()
    first = rr.render([_rec("long-seed1", "old outcome"), _rec("long-seed2", "seed 2")], tmp_path)
    second = rr.render([_rec("long-seed1", "new outcome"), _rec("trace-seed1", "trace")],
                       tmp_path, previous=first)  # fmt: skip
    rows = [line for line in second.splitlines() if line.startswith("| chaos |")]
    assert [r.split(" | ")[1] for r in rows] == ["long-seed1", "long-seed2", "trace-seed1"]
    assert "new outcome" in rows[0] and "old outcome" not in second
    assert "1 rows kept from the report before" in second
    for name in ("long-seed1", "long-seed2", "trace-seed1"):  # failures and timeline too
        assert f"| {name} | 503 no live workers | 3 |" in second
        assert f"| {name} | 1.0 kill prefill |" in second
    assert second.count("| long-seed1 | 503 no live workers | 3 |") == 1


def test_the_committed_report_keeps_every_row_through_a_new_run(tmp_path):
    rr = _report()
    doc = (ROOT / "docs/reliability.md").read_text()
    before = [line for line in doc.splitlines() if line.startswith(("| chaos |", "| fuzz |"))]
    again = rr.render([_rec("new-run", "fine")], tmp_path, previous=doc)
    for line in before:
        assert line in again
    assert "| chaos | new-run |" in again
