"""Per-worker metrics of a cluster's router, for /metrics (Prometheus) and /health (JSON).

The router keeps every worker that ever registered with its state (``up``, ``draining``,
``dead`` once its heartbeats stopped for the deadline, ``left`` after a goodbye) and what its
last heartbeat said. Each worker's series carry ``worker`` and ``role`` labels beside
``model_name``; the state is one gauge per state (1 for the current one), as Prometheus
exporters write enums, so ``engine:worker_state{state="dead"} == 1`` is an alert rule. Queue and
KV gauges are given for live workers only (a dead one's last report would read as current).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "engine:"
STATES = ("up", "draining", "dead", "left")
LIVE = ("up", "draining")

# (status key, metric name, help): gauges of live workers, from their last heartbeat.
_GAUGES = (
    ("running", "worker_num_requests_running", "Requests in the worker's running batch."),
    ("waiting", "worker_num_requests_waiting", "Requests waiting (or loading KV) in the worker."),
    ("kv_usage", "worker_kv_cache_usage_perc", "Fraction of the worker's KV blocks in use."),
    ("used_blocks", "worker_kv_used_blocks", "KV blocks in use in the worker's paged cache."),
    ("transfers", "worker_kv_transfers", "KV transfers in flight (sending or receiving)."),
    ("staging_used", "worker_kv_staging_used_bytes", "Bytes of the decode staging arena held."),
)


def worker_metrics(status: dict[str, dict], model_name: str) -> Iterator[Metric]:
    """The series of ``Router.workers_status()``."""
    labels = ["model_name", "worker", "role"]
    up = GaugeMetricFamily(
        PREFIX + "worker_up", "1 if the worker takes new requests, else 0.", labels=labels
    )
    state = GaugeMetricFamily(
        PREFIX + "worker_state",
        "1 for the worker's current state (up, draining, dead, left), 0 for the others.",
        labels=[*labels, "state"],
    )
    age = GaugeMetricFamily(
        PREFIX + "worker_heartbeat_age_seconds",
        "Seconds since the router last heard from the worker.",
        labels=labels,
    )
    gap = GaugeMetricFamily(
        PREFIX + "worker_heartbeat_gap_max_seconds",
        "The longest time between two heartbeats of the worker since it joined: against the "
        "router's --heartbeat-timeout, the margin before a slow or busy link reads as a death.",
        labels=labels,
    )
    gauges = [(key, GaugeMetricFamily(PREFIX + name, doc, labels=labels)) for key, name, doc in
              _GAUGES]  # fmt: skip
    finished = CounterMetricFamily(
        PREFIX + "worker_requests_finished",
        "Requests the worker's engine finished, by reason (handed_over: a prefill worker "
        "passed the request on to a decode worker).",
        labels=[*labels, "finished_reason"],
    )
    for wid, s in sorted(status.items()):
        lv = [model_name, wid, str(s.get("role", ""))]
        current = s.get("state", "")
        up.add_metric(lv, 1.0 if current == "up" else 0.0)
        for st in STATES:
            state.add_metric([*lv, st], 1.0 if current == st else 0.0)
        age.add_metric(lv, float(s.get("heartbeat_age_s", 0.0)))
        gap.add_metric(lv, float(s.get("heartbeat_gap_max_s", 0.0)))
        if current in LIVE:
            for key, g in gauges:
                g.add_metric(lv, float(s.get(key, 0)))
        for reason, count in sorted(s.get("finished", {}).items()):
            if isinstance(count, (int, float)) and not isinstance(count, bool):
                finished.add_metric([*lv, str(reason)], count)
    yield up
    yield state
    yield age
    yield gap
    for _, g in gauges:
        yield g
    yield finished


def health_body(status: dict[str, dict], healthy: bool) -> dict:
    """/health's JSON for a cluster: overall status and every worker's state and queues."""
    return {
        "status": "ok" if healthy else "unavailable",
        "workers": {
            wid: {k: v for k, v in s.items() if k != "finished"} for wid, s in status.items()
        },
    }
