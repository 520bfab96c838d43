"""The KV pool's trace replay (engine/bench/pool_replay.py) counts hits as the engine's prefix
match does."""

from __future__ import annotations

import json
import math

import pytest

from engine.bench.pool_replay import TraceRequest, load_trace, replay


def test_token_and_block_hit_rates_on_a_scripted_trace():
    trace = [
        TraceRequest([1, 2, 3], 1200),  # blocks of 512, 512, 176 tokens
        TraceRequest([1, 2, 4], 1100),  # first two blocks hit: 1024 tokens
        TraceRequest([1, 2, 3], 1200),  # whole prompt hits, the partial block by its length
        TraceRequest([9, 2, 3], 1200),  # a different first block: no prefix hit at all
    ]
    r = replay(trace, math.inf, "lru")
    assert r.tokens == pytest.approx((1024 + 1200) / 4700)
    assert r.blocks == pytest.approx(5 / 12)
    # One block of capacity: only the last block of each request survives, never a prefix.
    assert replay(trace, 1, "lru").blocks == 0


def test_load_trace_checks_lengths(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"hash_ids": [1, 2], "input_length": 600}) + "\n")
    assert load_trace(str(path)) == [TraceRequest([1, 2], 600)]
    path.write_text(json.dumps({"hash_ids": [1], "input_length": 600}) + "\n")
    with pytest.raises(ValueError, match="1 hash_ids for input_length 600"):
        load_trace(str(path))
