"""The serving benchmark's workloads and statistics (no model, no server)."""

from __future__ import annotations

import argparse
import json
import math

from engine.bench.arrivals import arrival_delays
from engine.bench.backends import RequestResult
from engine.bench.datasets import mooncake_requests, random_requests
from engine.bench.summary import summarize


class _Tok:
    vocab_size = 1000
    all_special_ids = [0, 1, 2]


def test_random_requests_lengths_prefix_and_seed():
    reqs = random_requests(_Tok(), 20, 50, 8, prefix_len=10, range_ratio=0.2, seed=1)
    again = random_requests(_Tok(), 20, 50, 8, prefix_len=10, range_ratio=0.2, seed=1)
    assert [r.prompt for r in reqs] == [r.prompt for r in again]
    assert all(40 + 10 <= len(r.prompt) <= 60 + 10 for r in reqs)
    assert len({tuple(r.prompt[:10]) for r in reqs}) == 1  # the shared prefix
    assert all(not set(r.prompt) & {0, 1, 2} for r in reqs)
    clipped = random_requests(_Tok(), 3, 500, 100, max_model_len=256)
    assert all(len(r.prompt) + r.output_len <= 256 for r in clipped)


def test_mooncake_requests_share_blocks(tmp_path):
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 64, "hash_ids": [0, 1, 2]},
        {"timestamp": 500, "input_length": 700, "output_length": 32, "hash_ids": [0, 1]},
        {"timestamp": 1500, "input_length": 300, "output_length": 1, "hash_ids": [9]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    reqs = mooncake_requests(_Tok(), str(path), 10, scale=1 / 32)
    assert [len(r.prompt) for r in reqs] == [34, 22, 9]  # lengths scaled by 1/32
    assert [r.output_len for r in reqs] == [2, 1, 1]
    assert reqs[0].prompt[:16] == reqs[1].prompt[:16]  # hash id 0: the same 16 tokens
    assert reqs[0].prompt[16:22] == reqs[1].prompt[16:22]
    assert reqs[2].prompt[:9] != reqs[0].prompt[:9]
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 1.5]


def _args(**kw) -> argparse.Namespace:
    base = dict(
        dataset_name="random",
        request_rate=None,
        burstiness=1.0,
        seed=0,
        mooncake_time_scale=1.0,
        goodput={"ttft": 100.0, "tpot": 20.0},
        metric_percentiles=[50.0, 90.0, 99.0],
        max_concurrency=4,
    )
    return argparse.Namespace(**(base | kw))


def test_arrivals():
    reqs = random_requests(_Tok(), 200, 5, 2)
    assert arrival_delays(_args(), reqs) == [0.0] * 200
    delays = arrival_delays(_args(request_rate=10.0), reqs)
    assert delays[0] == 0.0 and all(b >= a for a, b in zip(delays, delays[1:]))
    assert 10 < delays[-1] < 30  # ~200 requests at 10/s


def test_summarize_definitions():
    results = [
        RequestResult(True, 10, 11, 0.0, ttft=0.05, e2el=0.25, itl=[0.02] * 10),
        RequestResult(True, 10, 11, 0.1, ttft=0.20, e2el=0.40, itl=[0.02] * 10),
        RequestResult(False, 10, 0, 0.2, error="HTTP 429"),
    ]
    s = summarize(
        "http", {"duration": 2.0, "results": results, "prefix_cache_hit_rate": 0.0}, _args()
    )
    assert s["completed"] == 2 and s["failed"] == 1
    assert math.isclose(s["mean_tpot_ms"], 20.0)  # (e2e - ttft) / (output - 1)
    assert math.isclose(s["mean_ttft_ms"], 125.0) and math.isclose(s["median_itl_ms"], 20.0)
    assert s["request_goodput"] == 0.5  # only the first meets ttft <= 100 ms
    assert s["output_throughput"] == 11.0 and s["errors"] == ["HTTP 429"]
