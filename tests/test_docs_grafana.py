"""docs/grafana/engine.json, the Grafana dashboard for the engine's Prometheus metrics: valid
JSON whose every query names only series /metrics really exposes (rendered here by the server's
own collector, with a KV pool and a cluster's workers so that every family appears)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from engine.core.metrics import EngineMetrics
from engine.server.prometheus import EngineCollector, make_registry, render

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "engine.json"


class _Cluster:
    """What the collector reads of an engine client: a router with one worker and a KV pool."""

    def metrics(self):
        tier = {"hits": 1, "misses": 1, "blocks": 3, "bytes_read": 1, "bytes_written": 1}
        pool = {"tiers": {"dram": tier, "ssd": tier}, "loads": 1}
        snap = EngineMetrics().snapshot(1, 2, 0.5, num_blocks=8, kv_pool=pool)
        return dataclasses.replace(snap, finished={"stop": 1})

    def workers_status(self):
        return {"w0": {"role": "decode", "state": "up", "running": 1, "finished": {"stop": 1}}}


def exposed_series() -> set[str]:
    text = render(make_registry(EngineCollector(_Cluster(), "m"))).decode()
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def test_every_query_names_an_exposed_series():
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    named = {n for e in exprs for n in re.findall(r"engine:[A-Za-z0-9_]+", e)}
    exposed = exposed_series()
    assert named and named <= exposed, sorted(named - exposed)
    # The panels cover the engine's own families (queues, KV, prefix cache, tokens, latency).
    for family in ("num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hits_total",
                   "generation_tokens_total", "time_to_first_token_seconds_bucket",
                   "inter_token_latency_seconds_bucket"):  # fmt: skip
        assert "engine:" + family in named, family
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
