"""Mooncake-format request traces (data/traces/mooncake/README.md): one JSON object a
line with ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids`` (one chained
id per 512-token block, the last block possibly partial).

The bundled trace, ``DEFAULT_TRACE``, is a file of the repository, not of the package: it is found
from this file's place in the checkout (``<repo>/engine/sim/trace.py`` -> ``<repo>/data/traces``),
which is where the package lives when installed editable (``pip install -e .``, as the Makefile
does) or imported from the checkout. An installed copy outside a checkout has no such file; pass
the trace's path (``--trace FILE``) instead, and a missing file is an ``OSError`` naming it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

# The repository holding this package (engine/sim/trace.py -> its checkout's root).
REPO = Path(__file__).resolve().parents[2]
# The Mooncake authors' one-hour conversation trace, in the repository (Apache-2.0).
TRACES = REPO / "data" / "traces"
DEFAULT_TRACE = TRACES / "mooncake" / "conversation_trace.jsonl"


class TraceRequest(NamedTuple):
    index: int
    arrival_s: float  # replay time (trace time divided by the speed)
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...]


def load_trace(
    path: str | Path, speed: float = 1.0, limit: int = 0, duration_s: float = 0.0
) -> list[TraceRequest]:
    """Requests in arrival order, replayed ``speed`` times faster; ``limit`` > 0 keeps the first
    that many, ``duration_s`` > 0 those arriving within that many seconds of trace time."""
    if not speed > 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    out: list[TraceRequest] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                ts, n_in, n_out = (
                    float(r["timestamp"]),
                    int(r["input_length"]),
                    int(r["output_length"]),
                )
                ids = tuple(int(h) for h in r["hash_ids"])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record ({e})") from None
            if n_in < 1 or n_out < 1:
                raise ValueError(f"{path}:{lineno}: input_length and output_length must be >= 1")
            if duration_s and ts / 1000.0 > duration_s:
                break
            out.append(TraceRequest(len(out), ts / 1000.0 / speed, n_in, n_out, ids))
            if limit and len(out) >= limit:
                break
    out.sort(key=lambda r: (r.arrival_s, r.index))
    return out
