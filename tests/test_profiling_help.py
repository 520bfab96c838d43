"""Every benchmark script parses its arguments: `--help` exits 0. (Two merged features once added
the same option to one script, which then failed before measuring anything.)"""

from __future__ import annotations

import glob
import os
import runpy
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(
    p
    for p in glob.glob(os.path.join(ROOT, "profiling", "*.py"))
    if "argparse" in open(p).read() and "__main__" in open(p).read()
)


@pytest.mark.parametrize("path", SCRIPTS, ids=os.path.basename)
def test_help_exits_zero(path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [path, "--help"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_path(path, run_name="__main__")
    assert exc.value.code in (0, None)
    assert "usage" in capsys.readouterr().out.lower()
