"""The dashboard in front of a real cluster (the router in this process, one prefill and one
decode worker process) behind an API key, as ``engine cluster --api-key`` serves it: the data
list both workers and the Conductor's decision for a request just made; headless Chromium shows
the same (the key typed into the page), with no console error, and leaves a screenshot."""

from __future__ import annotations

import time

import httpx
import pytest
from dashboard_browser import open_dashboard, skip_reason
from server.serverutil import http_server

from engine.cluster.launcher import Cluster
from engine.cluster.router.router import RouterConfig

WORKER_ARGS = ["--kv-cache-memory-gb", "0.25", "--kv-staging-mb", "64", "--dtype", "float32"]
KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}

pytestmark = pytest.mark.slow  # a cluster's start and a browser: over 20 s


@pytest.fixture(scope="module")
def server():
    with Cluster(1, 1, worker_args=WORKER_ARGS, router_config=RouterConfig()) as c:
        with http_server(c.router, api_key=KEY) as srv:
            yield srv


def complete(url: str, request_id: str) -> dict:
    body = {"model": "default", "prompt": "Hello, my name is", "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, "request_id": request_id}  # fmt: skip
    r = httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def data(url: str) -> dict:
    r = httpx.get(url + "/dashboard/data", headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_cluster_data_after_a_request(server):
    assert httpx.get(server.url + "/dashboard/data").status_code == 401
    before = data(server.url)
    complete(server.url, "dash-data-1")
    d = data(server.url)
    assert d["kind"] == "cluster" and d["healthy"] is True
    roles = {w["id"]: w["role"] for w in d["workers"]}
    assert sorted(roles.values()) == ["decode", "prefill"], d["workers"]
    assert all(w["state"] == "up" for w in d["workers"])
    assert d["engine"]["requests_finished"] == before["engine"]["requests_finished"] + 1
    assert d["engine"]["generation_tokens"] >= before["engine"]["generation_tokens"] + 4
    assert d["engine"]["ttft"]["count"] == before["engine"]["ttft"]["count"] + 1
    mine = [x for x in d["decisions"] if "dash-data-1" in x["request_id"]]
    assert len(mine) == 1, d["decisions"]
    [x] = mine
    assert x["accepted"] and x["reason"] == ""
    assert roles[x["prefill"]] == "prefill" and roles[x["decode"]] == "decode"
    assert x["est_ttft_s"] is not None and x["est_ttft_s"] > 0
    assert before["time"] <= x["time"] <= d["time"]


def test_browser_shows_workers_and_a_request(server, tmp_path):
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    workers = [w["id"] for w in data(server.url)["workers"]]
    shot = tmp_path / "dashboard.png"

    def wait_for(page):
        for wid in workers:
            page.wait_for_selector(f'#workers tr[data-worker="{wid}"]')
        complete(server.url, "dash-browser-1")  # a request made while the page is open
        page.wait_for_function(
            "[...document.querySelectorAll('#decisions td')]"
            ".some(td => td.textContent.includes('dash-browser-1'))"
        )
        page.wait_for_function("Number(document.getElementById('finished').textContent) >= 1")
        time.sleep(2.5)  # one more poll: the charts have two points and a rate

    errors = open_dashboard(server.url + "/dashboard", shot, KEY, wait_for)
    print(f"dashboard screenshot: {shot}")
    assert errors == [], errors
    assert shot.stat().st_size > 10_000
