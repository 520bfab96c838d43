"""Records of what the reliability suites tried (faults, inputs, counts, durations) and what
happened, one JSON file per test, for ``profiling/reliability_report.py`` to render as the table
of docs/reliability.md. Written under ENGINE_RELIABILITY_DIR (default
``.reliability/`` in the repository, ignored by git); a record is written only when the test's
checks passed (a failing test leaves its failure in pytest's output instead)."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def record_dir() -> Path:
    return Path(os.environ.get("ENGINE_RELIABILITY_DIR") or REPO / ".reliability")


def write_record(
    suite: str,
    name: str,
    tried: str,
    counts: dict,
    outcome: str,
    lost: str = "nothing",
    duration_s: float | None = None,
    extra: dict | None = None,
) -> Path:
    """One row: ``suite`` (chaos, fuzz, doors, soak), what was ``tried``, the ``counts`` of
    inputs or faults, the ``outcome``, and what was ``lost`` (the goal: nothing)."""
    d = record_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{suite}-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.json"
    rec = {
        "suite": suite,
        "name": name,
        "tried": tried,
        "counts": counts,
        "outcome": outcome,
        "lost": lost,
        "duration_s": None if duration_s is None else round(duration_s, 1),
        "when": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        **(extra or {}),
    }
    path.write_text(json.dumps(rec, indent=1, sort_keys=True))
    return path
