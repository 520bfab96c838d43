"""The multi-host lines of docs/cluster.md as the commands each host runs: the blocks whose
doc-test marker names tests/netlab/test_multi_host.py, continuation lines joined, each command
under the host its ``# 10.0.0.N`` comment names, and the option lines (``#   --opt value``)
that a block adds to the workers' lines."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "cluster.md"
MARK = "tests/netlab/test_multi_host.py"
_HOST = re.compile(r"^#\s*(10\.0\.0\.\d+)\b")
_OPTIONS = re.compile(r"^#\s+(--\S.*)$")


@dataclass(frozen=True)
class HostCommand:
    host: str  # the doc's address (10.0.0.N)
    argv: tuple[str, ...]

    @property
    def program(self) -> str:
        """What it starts: "pool", "router", "prefill", "decode" or "mooncake_master"."""
        if self.argv[0].endswith("mooncake_master"):
            return "mooncake_master"
        if self.argv[1] == "worker":
            return self.argv[self.argv.index("--role") + 1]
        return self.argv[1]


@dataclass(frozen=True)
class DocBlock:
    commands: tuple[HostCommand, ...]
    worker_options: tuple[str, ...]  # what the block adds to the workers' lines


def doc_blocks(path: Path = DOC) -> list[DocBlock]:
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.startswith("<!-- doc-test:") and MARK in line:
            assert lines[i + 1].startswith("```bash"), f"{path}:{i + 2}: a bash block"
            end = lines.index("```", i + 2)
            out.append(parse_block(lines[i + 2 : end]))
    return out


def parse_block(lines: list[str]) -> DocBlock:
    commands, options, host = [], [], ""
    text = "\n".join(lines).replace("\\\n", " ")
    for line in text.splitlines():
        line = line.strip()
        if m := _HOST.match(line):
            host = m.group(1)
        elif m := _OPTIONS.match(line):
            options += shlex.split(m.group(1))
        elif line and not line.startswith("#"):
            assert host, f"a command before any '# 10.0.0.N' line: {line}"
            commands.append(HostCommand(host, tuple(shlex.split(line))))
    return DocBlock(tuple(commands), tuple(options))


def substitute(argv: tuple[str, ...], mapping: dict[str, str]) -> list[str]:
    """argv with every occurrence of each key replaced (addresses, the key directory)."""
    out = []
    for arg in argv:
        for old, new in mapping.items():
            arg = arg.replace(old, new)
        out.append(arg)
    return out


def without_option(argv: list[str], name: str) -> list[str]:
    """argv less ``name VALUE`` (every occurrence)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        else:
            out.append(arg)
    return out
