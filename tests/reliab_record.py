"""Records of what the reliability suites tried (faults, inputs, counts, durations) and what
happened, one JSON file per test, for ``profiling/reliability_report.py`` to render as the table
of docs/reliability.md. Written under ENGINE_RELIABILITY_DIR (default
``.reliability/`` in the repository, ignored by git).

A test hands its record to ``record_if_the_run_passes`` once its own checks passed; the session
hook of tests/conftest.py writes every such record at the end of the run if no test failed
(``write_held_records``), and otherwise says why it wrote none. So a record stands for a green
run, and no test fails because another one did."""

from __future__ import annotations

import copy
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
    when: time.struct_time | None = None,
) -> Path:
    """One row: ``suite`` (chaos, fuzz, doors, soak), what was ``tried``, the ``counts`` of
    inputs or faults, the ``outcome``, and what was ``lost`` (the goal: nothing). ``when``: the
    UTC time it happened (default now)."""
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
        "when": time.strftime("%Y-%m-%d %H:%M:%S", when or time.gmtime()),
        **(extra or {}),
    }
    path.write_text(json.dumps(rec, indent=1, sort_keys=True))
    return path


_held: list[dict] = []  # records of this session, written at its end if it passed


def record_if_the_run_passes(
    suite: str, name: str, tried: str, counts: dict, outcome: str, **kw
) -> None:
    """write_record's arguments, kept until the session ends (copied, and the time taken, now):
    the session hook writes the record then if no test of the run failed."""
    rec = dict(suite=suite, name=name, tried=tried, counts=counts, outcome=outcome, **kw)
    _held.append(copy.deepcopy(rec) | {"when": time.gmtime()})


def write_held_records(testsfailed: int, interrupted: bool = False) -> str | None:
    """At the end of a session: the held records written if no test failed (None), or a line
    saying why none was (the records are dropped either way)."""
    held = list(_held)
    _held.clear()
    if not held:
        return None
    names = ", ".join(f"{r['suite']}-{r['name']}" for r in held)
    if testsfailed:
        tests = "test" if testsfailed == 1 else "tests"
        return f"reliability records not written ({names}): {testsfailed} {tests} failed"
    if interrupted:
        return f"reliability records not written ({names}): the run was interrupted"
    for rec in held:
        write_record(**rec)
    return None
