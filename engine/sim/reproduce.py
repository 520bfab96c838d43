"""Reproduce the Mooncake papers' scheduling results on the simulated cluster (``make reproduce``).

Runs the simulator (engine/sim/simulator.py) with the real Conductor on the public conversation
trace and writes docs/reproduction.md (our figures beside the paper's, the command of every run,
why they differ) and its plots under docs/figures/. Four experiments:

1. average TTFT by placement policy (FAST'25 Fig. 5), and the balancing threshold swept;
2. rejected requests under overload with no, early and predicted early rejection (arXiv-v3
   Table 3), with prefill and decode load over time (arXiv-v3 Fig. 9-10);
3. requests meeting both SLOs, disaggregated vs colocated, at TBT 100/200/300 ms (FAST'25 Fig. 1);
4. prefix cache hit rate against capacity and eviction policy (arXiv-v3 Table 1);
5. TTFT of long prompts on single prefill instances and on prefill groups (chunked pipeline
   parallelism).

``--quick`` runs each on the first 10 minutes of the trace (a smoke test of this script).

This module is the command's body (profiling/reproduce.py runs it): the arguments, the order of
the experiments (engine/sim/experiments.py), the plots (engine/sim/plots.py), the document
(engine/sim/report.py) and the results cache docs/figures/results.json, which ``--only`` reads
for the experiments it does not rerun. ``--out`` defaults to the
docs/ folder of the repository holding this package (engine.sim.trace.REPO says how it is found).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from engine.sim.experiments import (
    INF,
    Runner,
    exp_colocated,
    exp_hit_rate,
    exp_long_prompts,
    exp_policies,
    exp_rejection,
)
from engine.sim.plots import plot_colocated, plot_hit_rate, plot_policies, plot_rejection
from engine.sim.report import write_doc
from engine.sim.trace import DEFAULT_TRACE, REPO

ROOT = REPO


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Reproduce the Mooncake scheduling results")
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--out", default=str(ROOT / "docs"))
    ap.add_argument("--quick", action="store_true", help="first 10 minutes of the trace only")
    ap.add_argument(
        "--only", choices=("policies", "rejection", "colocated", "hit_rate", "long_prompts")
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    figs = out / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    r = Runner(Path(args.trace), args.quick)
    cache = figs / "results.json"
    saved = json.loads(cache.read_text()) if args.only and cache.exists() else {}
    results = {}
    walls = dict(_load("walls", saved["walls"])) if "walls" in saved else {}
    for name, fn in (
        ("policies", exp_policies),
        ("rejection", exp_rejection),
        ("colocated", exp_colocated),
        ("hit_rate", exp_hit_rate),
        ("long_prompts", exp_long_prompts),
    ):
        if args.only and name != args.only and name in saved:
            results[name] = _load(name, saved[name])
            continue
        print(f"{name}:", file=sys.stderr, flush=True)
        t1 = time.perf_counter()
        results[name] = fn(r)
        walls[name] = time.perf_counter() - t1
    results["walls"] = walls
    cache.write_text(json.dumps({k: _dump(v) for k, v in results.items()}))
    plot_policies(results["policies"], figs / "policies.png")
    plot_rejection(results["rejection"], figs / "rejection_load.png")
    plot_colocated(results["colocated"], figs / "colocated.png")
    plot_hit_rate(results["hit_rate"], figs / "hit_rate.png")
    write_doc(
        out / "reproduction.md",
        results["policies"],
        results["rejection"],
        results["colocated"],
        results["hit_rate"],
        results["long_prompts"],
        r,
        sum(walls.values()),
    )
    print(f"wrote {out / 'reproduction.md'}", file=sys.stderr)
    return 0


def _dump(obj):
    """JSON for results keyed by floats and tuples (and holding inf)."""
    if isinstance(obj, dict):
        return [[_dump(k), _dump(v)] for k, v in obj.items()]
    if isinstance(obj, (list, tuple)):
        return {"t": [_dump(x) for x in obj]}
    if isinstance(obj, float) and not math.isfinite(obj):
        return "inf"
    return obj


def _load(name, obj):
    if isinstance(obj, list):
        return {_key(_load(name, k)): _load(name, v) for k, v in obj}
    if isinstance(obj, dict) and "t" in obj:
        return tuple(_load(name, x) for x in obj["t"])
    if obj == "inf":
        return INF
    return obj


def _key(k):
    return tuple(k) if isinstance(k, list) else k
