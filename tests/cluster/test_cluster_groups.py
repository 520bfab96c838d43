"""A pipelined prefill group (chunked pipeline parallelism) through HTTP equals colocated serving:
``engine cluster --prefill 0 --prefill-groups 1 --stages N`` (real worker processes, each stage
loading only its layers) answers greedy and seeded completions with logprobs exactly as
``engine serve`` does with the same prefill budget: prompts of one chunk and of many chunks,
then one sharing a long prefix with an earlier prompt (a prefix hit on every stage of the group;
the cached tokens reported equal too). Text, every token's logprob and the top logprobs compare
exactly (the JSON floats, bit for bit), as the 1P+1D cluster's do (test_cluster_bitwise.py).
float32 on one thread in every process (float32 sums depend on the thread count). 2 stages in
the default suite, 3 under ``slow``; SIGTERM stops everything."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import psutil
import pytest
from cluster_procs import wait_healthy

from engine.ipc.ports import free_port

CHUNK = 64  # the prefill budget: the group's chunk, and the colocated engine's
COMMON = ["--dtype", "float32", "--kv-cache-memory-gb", "0.25",
          "--max-num-batched-tokens", str(CHUNK)]  # fmt: skip
WORDS = " ".join(f"word{i}" for i in range(150))  # ~450 tokens: seven chunks


def requests() -> list[dict]:
    """Completion bodies in order: one chunk greedy, many chunks seeded and greedy, a prompt
    sharing the long one's first 110 words (~330 tokens, whole blocks of it cached), and one
    whose only token is the first (the last stage's hand-over with nothing to decode)."""
    short = "The capital of France is"
    long = WORDS
    shared = " ".join(WORDS.split()[:110]) + " and then the story goes on"
    greedy = {"temperature": 0, "max_tokens": 8, "logprobs": 3}
    seeded = {"temperature": 0.9, "top_p": 0.95, "seed": 7, "max_tokens": 8, "logprobs": 3}
    one = {"temperature": 0, "max_tokens": 1, "logprobs": 3}  # ends at the first token
    bodies = [(short, greedy), (long, seeded), (long, greedy), (shared, seeded), (long, one)]
    return [{"model": "default", "prompt": p, **sp} for p, sp in bodies]


def env() -> dict:
    e = dict(os.environ, OMP_NUM_THREADS="1")
    e["PYTHONPATH"] = os.getcwd() + os.pathsep + e.get("PYTHONPATH", "")
    return e


def answers(cmd: list[str], bodies: list[dict], check=None) -> list[tuple]:
    """Start the server, send the bodies one at a time, SIGTERM it (exit 0, no child left)."""
    port = free_port()
    proc = subprocess.Popen([*cmd, "--port", str(port)], env=env())
    children = []
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        children = psutil.Process(proc.pid).children(recursive=True)
        if check is not None:
            check(url, children)
        out = []
        for body in bodies:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            data = r.json()
            c = data["choices"][0]
            cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
            out.append((c["text"], c["logprobs"], c["finish_reason"], cached))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive
        return out
    finally:
        for c in children:
            if c.is_running():
                c.kill()
        if proc.poll() is None:
            proc.kill()


def run_group(stages: int) -> None:
    bodies = requests()
    want = answers([sys.executable, "-m", "engine", "serve", *COMMON], bodies)

    def check(url: str, children) -> None:
        stage_of = [c.cmdline()[c.cmdline().index("--stage") + 1] for c in children
                    if "--stage" in c.cmdline()]  # fmt: skip
        assert sorted(stage_of) == [f"{i}/{stages}" for i in range(stages)]
        workers = httpx.get(f"{url}/health", timeout=10).json()["workers"]
        assert sorted(w["stage"] for w in workers.values() if "stage" in w) == sorted(stage_of)

    cluster = [sys.executable, "-m", "engine", "cluster", "--prefill", "0", "--prefill-groups",
               "1", "--stages", str(stages), "--decode", "1", "--kv-staging-mb", "64",
               "--rejection", "none", *COMMON]  # fmt: skip
    got = answers(cluster, bodies, check)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"request {i}: the group's answer differs from colocated serving"
    assert want[3][3] >= 256  # the last one reused the shared prefix (on every stage)


@pytest.mark.slow  # CI time on a 2-core Zen 3 EPYC: `pytest -m slow`
def test_a_two_stage_group_equals_colocated_serving():
    run_group(2)


@pytest.mark.slow
def test_a_three_stage_group_equals_colocated_serving():
    run_group(3)
