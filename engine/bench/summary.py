"""The figures of a serving benchmark run (engine/bench/serve.py), as vLLM's ``bench serve``
defines them: TTFT, TPOT, ITL and e2e latency (mean, median, std, percentiles), throughput and
goodput (``summarize``), their table (``print_result``) and latency over time (``plot``); and
for runs repeated in rounds on a shared machine, the order of the systems in each round
(``round_order``) and each figure's median over the rounds (``median_over_rounds``)."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np

from engine.bench.backends import RequestResult

METRICS = ("ttft", "tpot", "itl", "e2el")
NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}
TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def summarize(backend: str, run: dict, args) -> dict:
    results: list[RequestResult] = run["results"]
    ok = [r for r in results if r.ok]
    duration = run["duration"]
    per = {
        "ttft": [r.ttft * 1000 for r in ok],
        "tpot": [(r.e2el - r.ttft) * 1000 / (r.output_len - 1) for r in ok if r.output_len > 1],
        "itl": [x * 1000 for r in ok for x in r.itl],
        "e2el": [r.e2el * 1000 for r in ok],
    }
    slo = dict(args.goodput or {})
    good = 0
    for r in ok:
        tpot = (r.e2el - r.ttft) * 1000 / (r.output_len - 1) if r.output_len > 1 else 0.0
        values = {"ttft": r.ttft * 1000, "tpot": tpot, "e2el": r.e2el * 1000}
        good += all(values[k] <= v for k, v in slo.items())
    total_in = sum(r.input_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    out = {
        "backend": backend,
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if slo else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate,
        "prefix_cache_hit_rate": run["prefix_cache_hit_rate"],
        "goodput_slo_ms": slo or None,
    }
    for m in METRICS:
        xs = np.array(per[m]) if per[m] else np.array([np.nan])
        out[f"mean_{m}_ms"] = float(np.mean(xs))
        out[f"median_{m}_ms"] = float(np.median(xs))
        out[f"std_{m}_ms"] = float(np.std(xs))
        for p in args.metric_percentiles:
            out[f"p{p:g}_{m}_ms"] = float(np.percentile(xs, p))
    out["errors"] = [r.error for r in results if not r.ok][:20]
    out["requests"] = [
        {k: v for k, v in asdict(r).items() if k != "itl"} for r in results
    ]  # per-request figures, for plots
    return out


def print_result(s: dict, args) -> None:
    w = 50
    print("{s:{c}^{n}}".format(s=f" Serving Benchmark Result ({s['backend']}) ", n=w, c="="))
    rows = [
        ("Successful requests:", s["completed"]),
        ("Failed requests:", s["failed"]),
        ("Maximum request concurrency:", s["max_concurrency"]),
        ("Benchmark duration (s):", f"{s['duration']:.2f}"),
        ("Total input tokens:", s["total_input_tokens"]),
        ("Total generated tokens:", s["total_output_tokens"]),
        ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
    ]
    if s["request_goodput"] is not None:
        rows.append(("Request goodput (req/s):", f"{s['request_goodput']:.2f}"))
    rows += [
        ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}"),
        ("Prefix cache hit rate:", f"{s['prefix_cache_hit_rate']:.1%}"),
    ]
    for k, v in rows:
        print(f"{k:<40}{v!s:<10}")
    for m in METRICS:
        print("{s:{c}^{n}}".format(s=TITLES[m], n=w, c="-"))
        print(f"{'Mean ' + NAMES[m] + ' (ms):':<40}{s[f'mean_{m}_ms']:<10.2f}")
        print(f"{'Median (P50) ' + NAMES[m] + ' (ms):':<40}{s[f'median_{m}_ms']:<10.2f}")
        for p in (p for p in args.metric_percentiles if p != 50):
            print(f"{f'P{p:g} ' + NAMES[m] + ' (ms):':<40}{s[f'p{p:g}_{m}_ms']:<10.2f}")
    for e in s["errors"][:5]:
        print("error:", e)
    print("=" * w)


def plot(summaries: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    rounds = len({s.get("round", 0) for s in summaries})
    for s in summaries:
        label = s["backend"] + (f" (round {s['round']})" if rounds > 1 else "")
        reqs = [r for r in s["requests"] if r["ok"]]
        t = [r["start_s"] + r["e2el"] for r in reqs]  # completion time
        start = [r["start_s"] for r in reqs]
        axes[0].scatter(start, [r["ttft"] * 1000 for r in reqs], s=8, label=label)
        tpot = [
            (r["e2el"] - r["ttft"]) * 1000 / (r["output_len"] - 1) if r["output_len"] > 1 else 0
            for r in reqs
        ]
        axes[1].scatter(start, tpot, s=8, label=label)
        order = np.argsort(t)
        done = np.arange(1, len(t) + 1)
        axes[2].plot(np.array(t)[order], done, label=label)
    axes[0].set_ylabel("TTFT (ms)")
    axes[1].set_ylabel("TPOT (ms)")
    axes[2].set_ylabel("requests completed")
    axes[2].set_xlabel("seconds since the benchmark started (TTFT/TPOT by request start)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Latency over time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def round_order(names: list[str], i: int) -> list[str]:
    """The systems' order in round ``i`` (from 0): as given in even rounds, reversed in odd
    ones (ABBA), so that a machine drifting faster or slower over the run favours none."""
    return list(names) if i % 2 == 0 else list(reversed(names))


def median_over_rounds(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """``rounds``: per round, each system's figures by name. Returns each system's figures, the
    median of each over the rounds the system ran in, systems in the first round's order."""
    if not rounds:
        raise ValueError("median_over_rounds: no rounds")
    names = list(dict.fromkeys(n for r in rounds for n in r))
    return {
        name: {
            key: float(np.median([r[name][key] for r in rounds if name in r]))
            for key in next(r[name] for r in rounds if name in r)
        }
        for name in names
    }
