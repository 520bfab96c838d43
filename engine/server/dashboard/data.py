"""``GET /dashboard/data``: one JSON snapshot of what the dashboard draws, from the same sources
as /metrics (the engine's or the router's metrics snapshot, the router's workers and the
Conductor's recent decisions), so the numbers agree with Prometheus'.

Counters are cumulative (since start); the page turns them into rates between two polls, and
TTFT/TPOT into means over each poll interval (the histograms' sum and count deltas).
"""

from __future__ import annotations

import time

from engine.core.metrics import MetricsSnapshot

# Per-worker fields of the router's status (cluster_metrics.py) the page shows.
WORKER_FIELDS = (
    "role",
    "state",
    "group",
    "stage",
    "running",
    "waiting",
    "kv_usage",
    "used_blocks",
    "transfers",
    "staging_used",
    "heartbeat_age_s",
)


def _histogram(buckets: list[tuple[float, int]], total: float) -> dict:
    """Count (the +Inf bucket's cumulative count) and sum of a histogram."""
    return {"count": buckets[-1][1] if buckets else 0, "sum": total}


def _pool(stats: dict) -> dict | None:
    if not stats:
        return None
    tiers = {
        tier: {k: ts.get(k, 0) for k in ("blocks", "hits", "misses", "evictions")}
        for tier, ts in sorted(stats.get("tiers", {}).items())
    }
    return {
        "tiers": tiers,
        **{k: stats.get(k, 0) for k in ("loads", "failed_loads", "dropped_writes")},
    }


def engine_summary(s: MetricsSnapshot) -> dict:
    return {
        "running": s.num_running,
        "waiting": s.num_waiting,
        "kv_usage": s.kv_usage,
        "kv_blocks": s.num_blocks,
        "prefix_cache_queries": s.prefix_queries,
        "prefix_cache_hits": s.prefix_hits,
        "prefix_cache_hit_rate": s.prefix_hits / s.prefix_queries if s.prefix_queries else None,
        "preemptions": s.preemptions,
        "prompt_tokens": s.prompt_tokens,
        "generation_tokens": s.generation_tokens,
        "requests_finished": sum(s.finished.values()),
        "finished": dict(s.finished),
        "ttft": _histogram(s.ttft, s.ttft_sum),
        "tpot": _histogram(s.itl, s.itl_sum),
        "e2e": _histogram(s.e2e, s.e2e_sum),
    }


def dashboard_data(llm, model_name: str, rejections: dict[str, int]) -> dict:
    """The snapshot; ``llm`` is an EngineClient, a cluster's router when it has workers_status."""
    s = llm.metrics()
    counts = dict(rejections)
    if s.rejected:
        counts["engine"] = counts.get("engine", 0) + s.rejected
    out = {
        "time": time.time(),
        "model": model_name,
        "kind": "engine",
        "healthy": llm.is_healthy(),
        "engine": engine_summary(s),
        "kv_pool": _pool(s.kv_pool),
        "rejections": counts,
        "workers": [
            {
                "id": "engine",
                "role": "prefill+decode",
                "state": "up",
                "running": s.num_running,
                "waiting": s.num_waiting,
                "kv_usage": s.kv_usage,
            }
        ],
        "decisions": None,
    }
    workers = getattr(llm, "workers_status", None)  # a cluster's router
    if workers is not None:
        out["kind"] = "cluster"
        out["workers"] = [
            {"id": wid, **{k: st[k] for k in WORKER_FIELDS if k in st}}
            for wid, st in sorted(workers().items())
        ]
        recent = getattr(llm, "recent_decisions", None)
        out["decisions"] = recent() if recent is not None else []
    return out
