"""GET /dashboard and /dashboard/data on the server ``engine serve`` runs (the real default model):
the page is served, self-contained (nothing fetched from another origin); the data reflect a
request just made; with an API key the page stays public and the data need the key."""

from __future__ import annotations

import re

import httpx
from serverutil import MODEL, http_server, wait_idle


def test_page_is_self_contained(http):
    r = http.get("/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert 'data-needs-key="false"' in page
    assert "/data" in page and "sessionStorage" in page
    # No CDN, no external script, style or image: every URL in the page is relative.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert not re.search(r"""fetch\(\s*["']https?:""", page)


def test_data_after_a_request(http, llm):
    before = http.get("/dashboard/data").json()
    r = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 5,
              "temperature": 0, "ignore_eos": True},
    )  # fmt: skip
    assert r.status_code == 200, r.text
    wait_idle(llm)
    d = http.get("/dashboard/data").json()
    e, e0 = d["engine"], before["engine"]
    assert d["kind"] == "engine" and d["model"] == MODEL and d["healthy"] is True
    assert d["decisions"] is None and d["kv_pool"] is None
    assert [w["id"] for w in d["workers"]] == ["engine"]
    assert e["requests_finished"] == e0["requests_finished"] + 1
    assert e["generation_tokens"] == e0["generation_tokens"] + 5
    assert e["prompt_tokens"] - e0["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert e["ttft"]["count"] == e0["ttft"]["count"] + 1 and e["ttft"]["sum"] > e0["ttft"]["sum"]
    assert e["tpot"]["count"] == e0["tpot"]["count"] + 4  # 5 tokens: 4 gaps
    assert e["running"] == e["waiting"] == 0 and e["kv_usage"] == 0.0 and e["kv_blocks"] > 0
    assert e["prefix_cache_queries"] > e0["prefix_cache_queries"]
    if e["prefix_cache_queries"]:
        rate = e["prefix_cache_hits"] / e["prefix_cache_queries"]
        assert e["prefix_cache_hit_rate"] == rate
    # The same numbers as Prometheus' /metrics.
    metrics = http.get("/metrics").text
    gen = re.search(r"^engine:generation_tokens_total\{[^}]*\} (\S+)$", metrics, re.M)
    assert float(gen.group(1)) >= e["generation_tokens"]


def test_api_key_protects_the_data_not_the_page(llm):
    with http_server(llm, api_key="sesame") as s, httpx.Client(base_url=s.url) as c:
        page = c.get("/dashboard")  # the page holds no data; it asks for the key first
        assert page.status_code == 200 and 'data-needs-key="true"' in page.text
        assert c.get("/dashboard/data").status_code == 401
        bad = c.get("/dashboard/data", headers={"Authorization": "Bearer wrong"})
        assert bad.status_code == 401
        ok = c.get("/dashboard/data", headers={"Authorization": "Bearer sesame"})
        assert ok.status_code == 200 and "engine" in ok.json()
        assert c.get("/dashboard/other").status_code == 401  # only the page itself is public
