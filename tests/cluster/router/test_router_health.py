"""The router's /health and /metrics cover its workers, against scripted workers (real ZeroMQ
sockets speaking the cluster's messages from a thread of this process; no model runs): a worker
whose heartbeats stop is shown dead once the heartbeat deadline passed, a draining one as
draining, live ones with their queues, KV usage and finished requests by reason, each series
labelled with the worker and its role; /health lists every worker and answers 503 once no
prefill worker is left. The real-process version (SIGKILL, SIGTERM) is in test_worker_health.py.
"""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest
import zmq
from cluster_checks import key, samples
from server.serverutil import http_server

from engine.cluster import messages as m
from engine.cluster.router.router import Router, RouterConfig


class Beaters:
    """Workers that register and send heartbeats (state, queues, KV usage) every 50 ms until
    silenced, as a worker killed with SIGKILL falls silent (no goodbye)."""

    def __init__(self, router: Router, roles: dict[str, str]) -> None:
        self.ctx = zmq.Context.instance()
        self.roles = roles
        self.beats: dict[str, m.Heartbeat] = {}
        self.socks: dict[str, zmq.Socket] = {}
        self.lock = threading.Lock()
        for wid, role in roles.items():
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(router.address)
            s.send_multipart(
                m.encode(m.Register(wid, role, os.getpid(), "default", 1024, "", "", "tcp", "h"))
            )
            self.socks[wid] = s
            self.beats[wid] = m.Heartbeat(wid, "up", 0, 0, 0.0, 0, 0, 0)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def set(self, hb: m.Heartbeat) -> None:
        with self.lock:
            self.beats[hb.worker_id] = hb

    def silence(self, wid: str) -> None:
        with self.lock:
            del self.beats[wid]

    def _loop(self) -> None:
        while not self.stop.wait(0.05):
            with self.lock:
                for wid, hb in self.beats.items():
                    self.socks[wid].send_multipart(m.encode(hb))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for s in self.socks.values():
            s.close(linger=0)


def wait_until(cond, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def cluster():
    router = Router(RouterConfig(heartbeat_timeout_s=0.5))
    roles = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}
    workers = Beaters(router, roles)
    try:
        router.wait_for_workers(2, 2, timeout=20)
        yield router, workers
    finally:
        workers.close()
        router.close()


def test_metrics_and_health_show_every_workers_state_and_load(cluster):
    router, workers = cluster
    workers.set(m.Heartbeat("d0", "up", 2, 1, 0.25, 40, 4096, 1))
    workers.set(m.Heartbeat("d1", "draining", 1, 0, 0.5, 8, 0, 0))
    workers.set(m.Heartbeat("p0", "up", 0, 3, 0.0, 0, 0, 0, finished={"handed_over": 3}))
    workers.silence("p1")  # as if SIGKILLed: no goodbye, heartbeats stop
    wait_until(
        lambda: (
            router.workers_status()["p1"]["state"] == "dead"
            and router.workers_status()["d1"]["state"] == "draining"
            and router.workers_status()["p0"]["finished"]
        ),
        "p1 dead by heartbeat, d1 draining",
    )
    with http_server(router) as srv:
        text = httpx.get(f"{srv.url}/metrics", timeout=30).text
        health = httpx.get(f"{srv.url}/health", timeout=30)
        s = samples(text)
        assert s[key("engine:worker_state", worker="p1", role="prefill", state="dead")] == 1
        assert s[key("engine:worker_state", worker="p1", role="prefill", state="up")] == 0
        assert s[key("engine:worker_up", worker="p1", role="prefill")] == 0
        assert s[key("engine:worker_state", worker="d1", role="decode", state="draining")] == 1
        assert s[key("engine:worker_up", worker="d1", role="decode")] == 0
        assert s[key("engine:worker_up", worker="d0", role="decode")] == 1
        assert s[key("engine:worker_num_requests_running", worker="d0", role="decode")] == 2
        assert s[key("engine:worker_num_requests_waiting", worker="p0", role="prefill")] == 3
        assert s[key("engine:worker_kv_cache_usage_perc", worker="d1", role="decode")] == 0.5
        assert s[key("engine:worker_kv_staging_used_bytes", worker="d0", role="decode")] == 4096
        finished = key("engine:worker_requests_finished_total", worker="p0", role="prefill",
                       finished_reason="handed_over")  # fmt: skip
        assert s[finished] == 3
        # A dead worker's last report is not shown as current load.
        assert key("engine:worker_num_requests_running", worker="p1", role="prefill") not in s
        assert s[key("engine:worker_heartbeat_age_seconds", worker="p1", role="prefill")] > 0.5
        gap = s[key("engine:worker_heartbeat_gap_max_seconds", worker="d0", role="decode")]
        assert 0 < gap < 5  # the longest time between two of d0's heartbeats
        # The engine's own series are still there, under their names.
        assert any(name == "engine:num_requests_running" for name, _ in s)
        assert any(name == "engine:cpu_isa_info" for name, _ in s)  # the router's own CPU

        assert health.status_code == 200, health.text
        ws = health.json()["workers"]
        assert health.json()["status"] == "ok"
        assert {w: ws[w]["state"] for w in ws} == {
            "p0": "up", "p1": "dead", "d0": "up", "d1": "draining"
        }  # fmt: skip
        assert ws["d0"]["running"] == 2 and ws["d0"]["role"] == "decode"

        # The last prefill worker falls silent: the cluster cannot serve, /health says why.
        workers.silence("p0")
        wait_until(lambda: router.workers_status()["p0"]["state"] == "dead", "p0 dead")
        health = httpx.get(f"{srv.url}/health", timeout=30)
        assert health.status_code == 503
        body = health.json()
        assert body["status"] == "unavailable" and body["error"]["code"] == 503
        assert body["workers"]["p0"]["state"] == "dead"


def test_the_clusters_prefix_cache_counters_are_the_prefill_workers(cluster):
    """The router's engine:prefix_cache_* (and the dashboard's hit rate) add up what the
    prefill workers report: prompts are looked up where they are prefilled; a decode worker's
    own lookups (KV it receives) are not the cluster's prefix hits."""
    router, workers = cluster
    workers.set(m.Heartbeat("p0", "up", 0, 0, 0.0, 0, 0, 0, prefix_queries=300, prefix_hits=96))
    workers.set(m.Heartbeat("p1", "up", 0, 0, 0.0, 0, 0, 0, prefix_queries=100, prefix_hits=32))
    workers.set(m.Heartbeat("d0", "up", 0, 0, 0.0, 0, 0, 0, prefix_queries=999, prefix_hits=999))
    wait_until(lambda: router.metrics().prefix_queries == 400, "the prefill workers' lookups")
    assert router.metrics().prefix_hits == 128
    with http_server(router) as srv:
        s = samples(httpx.get(f"{srv.url}/metrics", timeout=30).text)
        data = httpx.get(f"{srv.url}/dashboard/data", timeout=30).json()
    assert s[key("engine:prefix_cache_queries_total")] == 400
    assert s[key("engine:prefix_cache_hits_total")] == 128
    assert data["engine"]["prefix_cache_hit_rate"] == 128 / 400
