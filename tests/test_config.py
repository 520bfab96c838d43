"""engine/config.py is a leaf: plain values, no torch, nothing of ``engine/`` but the plain-value
modules it holds (the pipeline stage, the parsed kv_pool), so every layer may import it; and the
``kv_pool`` string is parsed once, by the config, into the ``PoolSpec`` the engine builds from."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_import_graph import import_graph

from engine.config import EngineConfig
from engine.pipeline_stage import PipelineStage
from engine.pool_spec import PoolSpec, parse_pool_spec

ROOT = Path(__file__).resolve().parent.parent
# what config.py may import of engine/
LEAVES = {"engine.pipeline_stage", "engine.pool_spec", "engine.speculative_config"}


def test_config_imports_only_plain_value_leaves():
    # every import in the files, lazy ones too: config.py's own, and theirs
    graph = import_graph(ROOT, "engine")
    assert graph["engine.config"] == LEAVES
    for leaf in sorted(LEAVES):
        assert graph[leaf] == set(), leaf


def test_importing_the_config_loads_no_torch_and_no_other_engine_module():
    # a fresh process: what `import engine` loads (its __init__ runs first whatever one
    # imports), then what the config adds to it
    script = (
        "import json, sys\n"
        "import engine\n"
        "before = set(sys.modules)\n"
        "import engine.config\n"
        "added = sorted(m for m in set(sys.modules) - before if m.startswith('engine'))\n"
        "print(json.dumps({'added': added, 'torch': 'torch' in sys.modules}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"added": sorted(LEAVES | {"engine.config"}), "torch": False}


def test_kv_pool_is_parsed_once_into_the_config():
    config = EngineConfig(kv_pool="dram=1GiB,policy=lfu")
    assert isinstance(config.pool_spec, PoolSpec)
    assert config.pool_spec == parse_pool_spec("dram=1GiB,policy=lfu")
    assert EngineConfig().pool_spec is None
    # derived from kv_pool: not an argument, not in the repr or the comparison, and a changed
    # kv_pool is parsed again
    with pytest.raises(TypeError):
        EngineConfig(pool_spec=config.pool_spec)  # type: ignore[call-arg]
    assert "pool_spec" not in repr(config)
    assert config == EngineConfig(kv_pool="dram=1GiB,policy=lfu")
    other = config.with_overrides(kv_pool="dram=2GiB")
    assert other.pool_spec == parse_pool_spec("dram=2GiB")
    assert dataclasses.replace(config, kv_pool=None).pool_spec is None


def test_bad_kv_pool_and_stage_fail_where_the_config_is_made():
    with pytest.raises(ValueError, match="kv_pool part 'dram=lots'"):
        EngineConfig(kv_pool="dram=lots")
    with pytest.raises(ValueError, match="pipeline stages run without a KV pool"):
        EngineConfig(kv_pool="dram=1GiB", stage=PipelineStage(0, 2))


def test_speculative_config_names_the_bad_field():
    from engine.config import SpeculativeConfig

    assert not SpeculativeConfig().enabled and SpeculativeConfig(method="ngram").enabled
    for kwargs, field in (
        ({"method": "eagle"}, "speculative method"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 33}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"prompt_lookup_min": 5, "prompt_lookup_max": 4}, "prompt_lookup_max"),
        ({"suffix_cache_requests": 0}, "suffix_cache_requests"),
        ({"suffix_min_token_prob": 1.0}, "suffix_min_token_prob"),
    ):
        with pytest.raises(ValueError, match=field):
            SpeculativeConfig(**kwargs)
    with pytest.raises(ValueError, match="speculative_config: unknown field 'k'"):
        SpeculativeConfig.from_dict({"method": "ngram", "k": 3})
    assert SpeculativeConfig.from_dict({"method": "suffix"}) == SpeculativeConfig(method="suffix")


def test_quantization_takes_int8_and_w8a8_from_the_command_line():
    import argparse

    from engine.cli.engine_options import add_engine_options, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_options(p)
    for name in ("int8", "w8a8"):
        args = p.parse_args(["--quantization", name])
        assert engine_config_from_args(args).quantization == name
    with pytest.raises(SystemExit):  # argparse names the choices
        p.parse_args(["--quantization", "fp4"])
    with pytest.raises(ValueError, match="quantization must be None or one of int8, w8a8"):
        EngineConfig(quantization="fp4")
