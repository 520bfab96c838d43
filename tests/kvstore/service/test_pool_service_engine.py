"""Engines sharing one real pool service (`engine pool serve`, a subprocess): a prefix computed by
one engine process is loaded, not recomputed, by another with identical greedy tokens; a service
killed with SIGKILL makes the engine recompute, and it uses the service again once restarted."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest
from pool_service_helpers import REPO, free_port, start_service, stop

from engine.llm import LLM
from engine.sampling_params import SamplingParams

PROMPT = list(range(3000, 3000 + 150))  # 9 full blocks of 16, then 6 tokens
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE_ARGS = dict(dtype="float32", device="cpu", num_blocks=128)

OTHER_ENGINE = textwrap.dedent(
    """
    import json, sys, torch
    torch.set_num_threads(1)
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    with LLM(dtype="float32", device="cpu", num_blocks=128, kv_pool=sys.argv[1]) as llm:
        out = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0.0, max_tokens=8,
                           ignore_eos=True))[0]
    print(json.dumps({"tokens": out.outputs[0].token_ids, "sources": out.metrics.kv_sources,
                      "computed": out.metrics.num_computed_prompt_tokens}))
    """
)


@pytest.fixture(scope="module")
def reference() -> list[int]:
    llm = LLM(**ENGINE_ARGS, enable_prefix_caching=False)
    return llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids


def test_second_engine_process_loads_from_the_service(reference):
    port = free_port()
    service = start_service("--dram", "64MiB", "--port", str(port))
    try:
        spec = f"dram=16MiB,tcp://127.0.0.1:{port}"
        with LLM(**ENGINE_ARGS, kv_pool=spec) as llm:
            first = llm.generate(PROMPT, GREEDY)[0]
            assert llm.engine.connector.flush()
        assert first.outputs[0].token_ids == reference
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        proc = subprocess.run(
            [sys.executable, "-c", OTHER_ENGINE, f"tcp://127.0.0.1:{port}", json.dumps(PROMPT)],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        assert got["tokens"] == reference
        assert got["sources"] == {"remote": 144}
        assert got["computed"] == 6  # only the tail ran in the second process
    finally:
        stop(service)


@pytest.mark.slow  # CI time on a 2-core Zen 3 EPYC: `pytest -m slow`
def test_dead_service_means_recompute_then_reconnect(reference, caplog):
    port = free_port()
    service = start_service("--dram", "64MiB", "--port", str(port))
    try:
        with LLM(**ENGINE_ARGS, kv_pool=f"tcp://127.0.0.1:{port}") as llm:
            llm.generate(PROMPT, GREEDY)
            assert llm.engine.connector.flush()
            llm.reset_prefix_cache()
            stop(service)  # SIGKILL
            with caplog.at_level(logging.WARNING):
                out = llm.generate(PROMPT, GREEDY)[0]
            assert out.outputs[0].token_ids == reference
            assert out.metrics.num_computed_prompt_tokens == 150  # recomputed, not failed
            llm.reset_prefix_cache()

            service = start_service("--dram", "64MiB", "--port", str(port))
            # The client retries the service after a back-off: within a deadline, a run saves
            # to the new service and the next one loads from it.
            deadline = time.monotonic() + 60
            while True:
                again = llm.generate(PROMPT, GREEDY)[0]
                assert llm.engine.connector.flush()
                llm.reset_prefix_cache()
                loaded = llm.generate(PROMPT, GREEDY)[0]
                llm.reset_prefix_cache()
                if loaded.metrics.kv_sources or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert again.outputs[0].token_ids == reference
            assert loaded.outputs[0].token_ids == reference
            assert loaded.metrics.kv_sources == {"remote": 144}
            llm.engine.check_integrity()
    finally:
        stop(service)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert 1 <= len(warnings) <= 3, [r.getMessage() for r in warnings]
