"""The tiered pool in the engine, on the real default model: a prefix loaded from DRAM, from SSD,
and from SSD by a new process after a restart gives the same greedy tokens as a full recompute,
and only the tail of the prompt runs. The pool service and Mooncake Store have their own tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams

PROMPT = list(range(2000, 2000 + 150))  # 9 full blocks of 16, then 6 tokens
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE_ARGS = dict(dtype="float32", device="cpu", num_blocks=128)


@pytest.fixture(scope="module")
def reference() -> list[int]:
    llm = LLM(**ENGINE_ARGS, enable_prefix_caching=False)
    return llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids


def run_twice(spec: str):
    """First run computes and saves; the device cache is reset; the second run loads."""
    with LLM(**ENGINE_ARGS, kv_pool=spec) as llm:
        first = llm.generate(PROMPT, GREEDY)[0]
        assert llm.engine.connector.flush()
        assert llm.reset_prefix_cache() > 0
        second = llm.generate(PROMPT, GREEDY)[0]
        llm.engine.check_integrity()
        snapshot = llm.engine.metrics_snapshot()
    return first, second, snapshot


@pytest.mark.parametrize("tier", ["dram", "ssd"])
def test_prefix_from_tier_matches_recompute(tier, tmp_path, reference):
    spec = "dram=32MiB" if tier == "dram" else f"ssd={tmp_path}:32MiB"
    first, second, snapshot = run_twice(spec)
    stats = snapshot.kv_pool
    assert first.outputs[0].token_ids == reference
    assert first.metrics.num_computed_prompt_tokens == 150
    assert second.outputs[0].token_ids == reference
    assert second.metrics.kv_sources == {tier: 144}
    assert second.metrics.num_cached_tokens == 144
    assert second.metrics.num_computed_prompt_tokens == 6  # only the tail ran
    # the load's own time, within the request's wait for its first token
    assert first.metrics.kv_load_time == 0.0
    ttft = second.metrics.first_token_time - second.metrics.arrival_time
    assert 0.0 < second.metrics.kv_load_time < ttft
    assert stats["tiers"][tier]["hits"] >= 9
    assert stats["loaded_blocks"] == 9 and stats["failed_loads"] == 0
    text = scrape(snapshot)
    assert f'engine:kv_pool_hits_total{{model_name="m",tier="{tier}"}} 9.0' in text
    assert 'engine:kv_pool_loads_total{model_name="m"} 1.0' in text
    assert f'engine:kv_pool_written_bytes_total{{model_name="m",tier="{tier}"}}' in text


def scrape(snapshot) -> str:
    from engine.server.prometheus import EngineCollector, make_registry, render

    class Source:
        def metrics(self):
            return snapshot

    return render(make_registry(EngineCollector(Source(), "m"))).decode()


RESTARTED = textwrap.dedent(
    """
    import json, sys, torch
    torch.set_num_threads(1)
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    llm = LLM(dtype="float32", device="cpu", num_blocks=128, kv_pool=sys.argv[1])
    out = llm.generate(list(range(2000, 2150)), SamplingParams(temperature=0.0, max_tokens=8,
                       ignore_eos=True))[0]
    llm.close()
    print(json.dumps({"tokens": out.outputs[0].token_ids, "sources": out.metrics.kv_sources,
                      "computed": out.metrics.num_computed_prompt_tokens}))
    """
)


def test_ssd_tier_survives_a_restart(tmp_path, reference):
    spec = f"ssd={tmp_path}:32MiB"
    with LLM(**ENGINE_ARGS, kv_pool=spec) as llm:
        llm.generate(PROMPT, GREEDY)
    # close() flushed the writes; a new process rebuilds the SSD index from the records.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", RESTARTED, spec],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["tokens"] == reference
    assert got["sources"] == {"ssd": 144}
    assert got["computed"] == 6


def test_corrupt_ssd_record_is_recomputed(tmp_path, reference):
    spec = f"ssd={tmp_path}:32MiB"
    with LLM(**ENGINE_ARGS, kv_pool=spec) as llm:
        llm.generate(PROMPT, GREEDY)
        llm.engine.connector.flush()
        llm.reset_prefix_cache()
        records = sorted(tmp_path.rglob("*.kvb"))
        assert records
        for p in records:  # flip one byte in the middle of every record
            data = bytearray(p.read_bytes())
            data[len(data) // 2] ^= 0xFF
            p.write_bytes(bytes(data))
        out = llm.generate(PROMPT, GREEDY)[0]
        assert out.outputs[0].token_ids == reference
        assert out.metrics.num_computed_prompt_tokens == 150
        stats = llm.engine.metrics_snapshot().kv_pool
        assert stats["failed_loads"] == 1
        llm.engine.check_integrity()


def test_the_namespace_hashes_the_weights_as_held():
    # float32, int8 and bf16 weights (under float32 activations) give different KV: engines of
    # each sharing a pool must never load one another's blocks (int8 was quantized after the
    # pool bound, so its namespace was the float weights' one)
    ids = []
    for kw in ({}, {"quantization": "int8"}, {"weight_dtype": "bfloat16"}):
        with LLM(**ENGINE_ARGS, kv_pool="dram=64MiB", **kw) as llm:
            ids.append(llm.engine.connector.store.namespace.id)
    assert len(set(ids)) == 3


def test_bad_pool_spec_names_the_part():
    with pytest.raises(ValueError, match="dram"):
        LLM(**ENGINE_ARGS, kv_pool="dram=lots")
