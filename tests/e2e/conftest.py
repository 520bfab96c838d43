"""At the end of a run that included tests/e2e/test_docs.py: every documented block's outcome,
each skip with its reason."""

from __future__ import annotations

_PREFIX = "test_docs.py::test_block["
_outcomes: dict[str, tuple[str, str, float]] = {}


def pytest_runtest_logreport(report):
    if _PREFIX not in report.nodeid:
        return
    block = report.nodeid.split(_PREFIX, 1)[1].rstrip("]")
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _outcomes[block] = ("skipped", reason.removeprefix("Skipped: "), 0.0)
    elif report.failed:
        _outcomes[block] = ("FAILED", "", report.duration)
    elif report.when == "call":
        _outcomes[block] = ("passed", "", report.duration)


def pytest_terminal_summary(terminalreporter):
    if not _outcomes:
        return
    tr = terminalreporter
    ran = sum(o[0] != "skipped" for o in _outcomes.values())
    tr.section(f"documented blocks: {ran} run, {len(_outcomes) - ran} skipped")
    for block, (outcome, reason, seconds) in _outcomes.items():
        detail = f"{seconds:6.1f} s" if outcome != "skipped" else reason
        tr.write_line(f"{outcome:8} {block:32} {detail}")
