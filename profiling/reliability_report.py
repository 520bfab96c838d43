"""Render docs/reliability.md from the records the reliability suites write (one JSON file per
test or run, in ``.reliability/`` by default; tests/reliab_record.py and profiling/soak.py write
them): what was tried, the counts of faults and inputs, durations, what happened and what was
lost. One command, after the suites ran:

    .venv/bin/python profiling/reliability_report.py [--dir DIR] [--out docs/reliability.md]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ORDER = {"chaos": 0, "soak": 1, "fuzz": 2, "doors": 3}

HEAD = """# Reliability and security: what was tried, what happened, what was lost

Written by `python profiling/reliability_report.py` from the records the suites wrote in their
last runs (`{dir}`, {n} records). The goal in the last column is "nothing".

How to produce the records (a fuzz or doors row is written at the end of a pytest run in
which no test failed, a chaos or soak row when its run passed):

<!-- doc-test: skip="the suites' long forms: an hour and more" -->
```bash
# default suite part: closed doors, bounded fuzzing, one short chaos scenario (~2 min)
.venv/bin/python -m pytest tests/ipc tests/fuzz tests/chaos -m "not slow"
# long forms, by hand: thousands of fuzz examples per socket and file format, long chaos runs
.venv/bin/python -m pytest tests/fuzz tests/chaos -m slow          # CHAOS_DURATION_S=240 each
.venv/bin/python tests/chaos/chaos_harness.py --duration 600 --seed 3
# soak through HTTP in front of a cluster (10 min), with its figure
.venv/bin/python profiling/soak.py --duration 600 --plot docs/figures/soak.png \\
    --record-dir .reliability
.venv/bin/python profiling/reliability_report.py                   # this file
```

"""

DOORS = """
## Closed doors (tests/ipc: the "doors" row)

- Every ZeroMQ socket of the cluster (router control, worker block events, KV), the pool service
  (requests, events) and the RPC server uses CURVE when keys are given (`engine keys generate
  DIR`, then `--curve-keys DIR` or `ENGINE_CURVE_KEYS=DIR` on every process; `engine cluster`
  passes it to its workers and pool service). A binding socket runs ZAP: a peer without CURVE,
  or with a key pair not in DIR, gets nothing (no reply, no registration). Binding beyond
  loopback without keys is refused unless `ENGINE_CURVE_INSECURE=1`.
- Every listener's default address is loopback (checked over the whole command line).
- Shared-memory names that travel between processes (a decode worker's staging arena, the pool
  service's arenas and host nonce) must carry our prefix and hold no path separator or `..`;
  anything else is refused before any file is opened.
- No code path unpickles, unmarshals or evaluates data (checked on the source by AST).
"""


def load(directory: Path) -> list[dict]:
    recs = []
    for path in sorted(directory.glob("*.json")):
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            print(f"skipping {path}: {exc}", file=sys.stderr)
            continue
        if isinstance(rec, dict) and {"suite", "name", "tried", "outcome"} <= set(rec):
            recs.append(rec)
    recs.sort(key=lambda r: (ORDER.get(r["suite"], 9), r["name"]))
    return recs


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _counts(counts: dict) -> str:
    if not isinstance(counts, dict):
        return _cell(counts)
    parts = []
    for k, v in counts.items():
        if isinstance(v, dict):
            parts.append(f"{k}: " + ", ".join(f"{kk} {vv}" for kk, vv in v.items()))
        else:
            parts.append(f"{k} {v}")
    return _cell("; ".join(parts))


def render(recs: list[dict], directory: Path) -> str:
    out = [HEAD.format(dir=directory.relative_to(REPO) if directory.is_relative_to(REPO)
                       else directory, n=len(recs))]  # fmt: skip
    cols = ["suite", "test", "what was tried", "counts", "duration", "what happened", "lost"]
    out.append("| " + " | ".join([*cols, "when"]) + " |")
    out.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in recs:
        dur = r.get("duration_s")
        out.append(
            f"| {r['suite']} | {_cell(r['name'])} | {_cell(r['tried'])} | "
            f"{_counts(r.get('counts', {}))} | {'' if dur is None else f'{dur:.0f} s'} | "
            f"{_cell(r['outcome'])} | {_cell(r.get('lost', ''))} | {r.get('when', '')} |"
        )
    details = [r for r in recs if isinstance(r.get("summary"), dict) and r["summary"].get("errors")]
    if details:
        out.append("\n## What the clients of the chaos runs saw when a request failed\n")
        out.append("Status 0: the connection was refused or closed (the router was down). ")
        out.append("Every failure here is a clear error: the request was not answered wrongly.\n")
        out.append("| run | status and reason | requests |")
        out.append("| --- | --- | --- |")
        for r in details:
            for reason, n in r["summary"]["errors"].items():
                out.append(f"| {r['name']} | {_cell(reason)} | {n} |")
        out.append("")
        out.append("| run | what happened when (s from the start) |")
        out.append("| --- | --- |")
        for r in details:
            tl = r["summary"].get("timeline", [])
            out.append(f"| {r['name']} | " + ", ".join(f"{t} {a} {n}" for t, a, n in tl) + " |")
    out.append(DOORS)
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=str(REPO / ".reliability"))
    ap.add_argument("--out", default=str(REPO / "docs" / "reliability.md"))
    args = ap.parse_args()
    directory = Path(args.dir).resolve()
    recs = load(directory)
    if not recs:
        print(f"no records in {directory}: run the suites first (see this script's doc)")
        return 1
    Path(args.out).write_text(render(recs, directory))
    print(f"{args.out}: {len(recs)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
