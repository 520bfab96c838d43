"""profiling/gpu_check.sh and what it runs, on this CPU machine: the script's dry run names every
step and what it would install; the bundle's model loads; the end-to-end steps (profiling/
gpu_e2e.py) all pass on the CPU, so the first lent GPU runs a script that worked the day before.
What only a GPU shows (Triton compiled, CUDA graphs, two workers sharing one device's memory) is
what the lent run measures."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env}
    full_env.pop("ENGINE_KERNELS", None)
    full_env.pop("TRITON_INTERPRET", None)
    full_env.update(env)
    return subprocess.run(
        cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-bundle")
    proc = run([sys.executable, "profiling/gpu_bundle.py", "--out", str(out), "--no-wheels"], 300)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.slow  # CI time on a 2-core Zen 3 EPYC: `pytest -m slow`
def test_dry_run_names_every_step():
    proc = run(["bash", "profiling/gpu_check.sh", "--dry-run"], 60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "profiling/kernels.py --json profiling/results/kernels.json" in out
    for step in ("env", "greedy", "pool", "pd", "graphs", "kvint8", "spec"):
        assert f"e2e {step}" in out
    assert "--model default --steps env,greedy" in out
    # Nothing ran: no results were written by a dry run.
    assert "would run" in out


def test_bundle_model_fits_and_loads(bundle):
    from engine import LLM, SamplingParams

    model = bundle / "model"
    size = sum(f.stat().st_size for f in model.iterdir())
    assert size < 40 * 2**20  # with the wheels (~21 MiB) under the 64 MiB a run carries
    config = json.loads((model / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    llm = LLM(str(model), kv_cache_memory_gb=0.05)
    out = llm.generate("Hello", SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.slow  # CI time on a 2-core Zen 3 EPYC: `pytest -m slow`
def test_e2e_steps_pass_on_cpu(bundle, tmp_path):
    out = tmp_path / "e2e"
    cmd = [sys.executable, "profiling/gpu_e2e.py", "--device", "cpu"]
    cmd += ["--model", str(bundle / "model"), "--out", str(out), "--kv-gb", "0.1"]
    proc = run(cmd + ["--decode-tokens", "24"], 900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((out / "e2e.json").read_text())
    assert all(r["ok"] for r in results.values()), results
    parity = results["greedy-parity"]
    assert parity["mismatches"] == [] and parity["prompt_logprob_excess"] <= 0
    assert results["pool"]["sources"].get("dram", 0) >= 144
    assert results["pd"]["equal_colocated"] == [True] * 4
    assert results["graphs"]["eager_batch8"]["decode_steps"] > 0
    assert results["spec"]["equal_plain"] == [True] * 4
    assert results["spec"]["spec"]["proposed"] > 0
    assert (out / "e2e.md").read_text().count("| yes |") == len(results)


@pytest.mark.slow
def test_e2e_greedy_through_triton_interpreter(bundle, tmp_path):
    """The greedy step with the engine's Triton kernels (interpreted): the parity check the GPU
    run makes, against the torch references."""
    out = tmp_path / "e2e"
    cmd = [sys.executable, "profiling/gpu_e2e.py", "--device", "cpu", "--steps", "greedy"]
    cmd += ["--model", str(bundle / "model"), "--out", str(out), "--timeout", "900"]
    proc = run(cmd, 1900, ENGINE_KERNELS="triton", TRITON_INTERPRET="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((out / "e2e.json").read_text())["greedy-parity"]["ok"]
