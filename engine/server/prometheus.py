"""Prometheus export: a collector that reads the engine's metrics snapshot on each scrape.

Names follow vLLM's with our prefix (``engine:time_to_first_token_seconds`` ...), each with a
``model_name`` label. Nothing is copied into prometheus-client's own metric objects: the engine
keeps the numbers, the collector only formats them, so there is one source of truth.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

PREFIX = "engine:"


class Rejections:
    """Requests the server turned away before the engine saw them, by reason."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, reason: str) -> None:
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class EngineCollector(Collector):
    def __init__(self, llm, model_name: str, rejections: Rejections | None = None) -> None:
        self.llm = llm
        self.model_name = model_name
        self.rejections = rejections or Rejections()

    def collect(self) -> Iterator[Metric]:
        s = self.llm.metrics()
        lv = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> Metric:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric(lv, value)
            return g

        def counter(name: str, doc: str, value: float) -> Metric:
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric(lv, value)
            return c

        def histogram(name: str, doc: str, buckets, total: float) -> Metric:
            h = HistogramMetricFamily(PREFIX + name, doc, labels=["model_name"])
            h.add_metric(lv, [(floatToGoString(b), c) for b, c in buckets], sum_value=total)
            return h

        yield gauge("num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0 to 1).", s.kv_usage)
        yield gauge("num_kv_blocks", "KV cache blocks in the paged cache.", s.num_blocks)
        yield counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_queries
        )
        yield counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_hits
        )
        yield counter("num_preemptions", "Requests preempted for lack of KV blocks.", s.preemptions)
        yield counter("prompt_tokens", "Prompt tokens received.", s.prompt_tokens)
        yield counter(
            "prompt_tokens_computed",
            "Prompt tokens run through the model (not served from the cache).",
            s.computed_prompt_tokens,
        )
        yield counter("generation_tokens", "Tokens generated.", s.generation_tokens)

        success = CounterMetricFamily(
            PREFIX + "request_success",
            "Finished requests, by finish reason.",
            labels=["model_name", "finished_reason"],
        )
        for reason, count in sorted(s.finished.items()):
            success.add_metric([self.model_name, str(reason)], count)
        yield success

        rejected = CounterMetricFamily(
            PREFIX + "request_rejected",
            "Requests turned away (queue full, shutting down, engine unavailable, engine "
            "admission), by reason.",
            labels=["model_name", "reason"],
        )
        counts = self.rejections.snapshot()
        if s.rejected:
            counts["engine"] = counts.get("engine", 0) + s.rejected
        for reason in ("queue_full", "shutting_down", "unavailable"):
            counts.setdefault(reason, 0)
        for reason, count in sorted(counts.items()):
            rejected.add_metric([self.model_name, reason], count)
        yield rejected

        yield histogram("time_to_first_token_seconds", "Time to first token.", s.ttft, s.ttft_sum)
        yield histogram(
            "inter_token_latency_seconds", "Time between consecutive tokens.", s.itl, s.itl_sum
        )
        yield histogram(
            "e2e_request_latency_seconds", "Arrival to finish of a request.", s.e2e, s.e2e_sum
        )
        yield histogram(
            "request_queue_time_seconds",
            "Arrival to first scheduling of a request.",
            s.queue_time,
            s.queue_time_sum,
        )
        yield from spec_metrics(s.spec, self.model_name)
        yield cpu_isa_metric(self.model_name)
        yield from pool_metrics(s.kv_pool, self.model_name)
        workers = getattr(self.llm, "workers_status", None)  # a cluster's router
        if workers is not None:
            from engine.server.cluster_metrics import worker_metrics

            yield from worker_metrics(workers(), self.model_name)


def cpu_isa_metric(model_name: str) -> Metric:
    """``engine:cpu_isa_info``, always 1: this process's CPU as the engine uses it
    (engine/cpu_isa.py under ENGINE_CPU_ISA): its model, level, cap and every feature "1" or "0".
    A cluster's router gives its own process's (its workers are started from the same
    environment; on another host, see that worker's log line)."""
    from engine import cpu_isa

    labels = cpu_isa.this_cpu().metric_labels()
    g = GaugeMetricFamily(
        PREFIX + "cpu_isa_info",
        "The CPU this process runs on and what the engine uses of it (ENGINE_CPU_ISA caps it).",
        labels=["model_name", *labels],
    )
    g.add_metric([model_name, *labels.values()], 1.0)
    return g


# Per-tier counters of the KV pool: (stats key, metric name, help).
_POOL_TIER_COUNTERS = (
    ("hits", "kv_pool_hits", "Blocks read from the KV pool, by tier."),
    ("misses", "kv_pool_misses", "Blocks looked for and not found in a tier."),
    ("bytes_read", "kv_pool_read_bytes", "Bytes read from the KV pool, by tier."),
    ("bytes_written", "kv_pool_written_bytes", "Bytes written to the KV pool, by tier."),
    ("evictions", "kv_pool_evictions", "Blocks evicted from a tier (DRAM evictions demote)."),
    ("failed_reads", "kv_pool_failed_reads", "Reads that failed (bad record, IO error), by tier."),
    ("failed_writes", "kv_pool_failed_writes", "Writes that failed (full disk, IO error)."),
)
_POOL_COUNTERS = (
    ("loads", "kv_pool_loads", "Requests whose prefix was loaded from the KV pool."),
    ("failed_loads", "kv_pool_failed_loads", "Loads that fell back to recompute."),
    ("dropped_writes", "kv_pool_dropped_writes", "Blocks not saved: the write queue was full."),
)


def pool_metrics(stats: dict, model_name: str) -> Iterator[Metric]:
    """The KV pool's counters, from the connector's stats (empty without a pool)."""
    if not stats:
        return
    tiers = stats.get("tiers", {})
    for key, name, doc in _POOL_TIER_COUNTERS:
        c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name", "tier"])
        for tier, ts in sorted(tiers.items()):
            c.add_metric([model_name, tier], ts.get(key, 0))
        yield c
    g = GaugeMetricFamily(
        PREFIX + "kv_pool_blocks", "Blocks held by each tier.", labels=["model_name", "tier"]
    )
    for tier, ts in sorted(tiers.items()):
        g.add_metric([model_name, tier], ts.get("blocks", 0))
    yield g
    for key, name, doc in _POOL_COUNTERS:
        c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        c.add_metric([model_name], stats.get(key, 0))
        yield c


def make_registry(collector: EngineCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)


def spec_metrics(spec: dict, model_name: str) -> Iterator[Metric]:
    """Speculative decoding's counters, as vLLM names them (``spec_decode_num_drafts`` is the
    verifications: a sequence with drafts in a step), and the mean tokens a verifying sequence
    gets per step (its kept drafts and the model's own token). Nothing when it is off."""
    if not spec:
        return
    lv = [model_name]
    for name, key, doc in (
        ("spec_decode_num_drafts", "verifications", "Sequence steps that verified drafts."),
        ("spec_decode_num_draft_tokens", "proposed", "Draft tokens proposed."),
        ("spec_decode_num_accepted_tokens", "accepted", "Draft tokens accepted."),
    ):
        c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        c.add_metric(lv, spec[key])
        yield c
    per = CounterMetricFamily(
        PREFIX + "spec_decode_num_accepted_tokens_per_pos",
        "Verifications that kept at least position + 1 drafts.",
        labels=["model_name", "position"],
    )
    for i, n in enumerate(spec["accepted_per_position"]):
        per.add_metric([model_name, str(i)], n)
    yield per
    g = GaugeMetricFamily(
        PREFIX + "spec_decode_mean_accepted_length",
        "Tokens a verifying sequence got per step, on average since start (kept drafts + 1).",
        labels=["model_name"],
    )
    n = spec["verifications"]
    g.add_metric(lv, 1.0 + spec["accepted"] / n if n else 0.0)
    yield g
