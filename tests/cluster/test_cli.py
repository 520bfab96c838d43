"""The command lines (slow): ``engine cluster`` behind HTTP (each process names its role on its
command line; SIGTERM stops them all, no orphans), and the roles started one by one from
addresses (``engine router`` on 127.0.0.1, a decode worker whose KV socket binds 127.0.0.2 over
TCP, a prefill worker)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from cluster_procs import wait_healthy

from engine.client import RPCClient
from engine.cluster.launcher import free_port
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

SMALL = ["--dtype", "float32", "--kv-cache-memory-gb", "0.25", "--kv-staging-mb", "64"]
BODY = {"model": "default", "prompt": "The capital of France is", "max_tokens": 8,
        "temperature": 0}  # fmt: skip


def env():
    e = dict(os.environ, OMP_NUM_THREADS="1")
    e["PYTHONPATH"] = os.getcwd() + os.pathsep + e.get("PYTHONPATH", "")
    return e


def complete(url: str) -> str:
    r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_engine_cluster_serves_and_stops_everything():
    port, rpc = free_port(), free_port()
    cmd = [sys.executable, "-m", "engine", "cluster", "--prefill", "1", "--decode", "1",
           "--port", str(port), "--rpc-address", f"tcp://127.0.0.1:{rpc}", *SMALL]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env())
    children = []
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        children = psutil.Process(proc.pid).children(recursive=True)
        roles = sorted(" ".join(c.cmdline()).split("--role ")[1].split()[0] for c in children)
        assert roles == ["decode", "prefill"]
        text = complete(url)
        with RPCClient(f"tcp://127.0.0.1:{rpc}", timeout=120) as client:
            r = client.generate(BODY["prompt"], SamplingParams(max_tokens=8, temperature=0))
        assert r.text == text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive
    finally:
        for c in children:
            if c.is_running():
                c.kill()
        if proc.poll() is None:
            proc.kill()


def test_roles_started_one_by_one_from_addresses():
    port, ctl = free_port(), free_port()
    router_addr = f"tcp://127.0.0.1:{ctl}"
    procs = []
    try:
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "engine", "router", "--address", router_addr,
             "--port", str(port)], env=env()))  # fmt: skip
        for role, extra in (("decode", ["--kv-host", "127.0.0.2", "--kv-transport", "tcp"]),
                            ("prefill", [])):  # fmt: skip
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "engine", "worker", "--role", role, "--router",
                 router_addr, "--threads", "1", *SMALL, *extra], env=env()))  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, procs[0])
        assert complete(url)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                assert p.wait(60) == 0
            except subprocess.TimeoutExpired:
                p.kill()
                raise


def test_pool_service_for_the_host():
    """``--pool-service``: one pool service, every worker writes its blocks there."""
    import asyncio
    import json

    from engine.cluster.launcher import Cluster

    with Cluster(1, 1, worker_args=SMALL, pool_service="dram=64MiB") as c:

        async def run():
            last = None
            params = SamplingParams(temperature=0, max_tokens=4)
            async for out in c.router.generate(list(range(1000, 1150)), params):
                last = out
            return last

        assert asyncio.run(run()).finished
        deadline = time.monotonic() + 30
        while True:
            stats = subprocess.run(
                [sys.executable, "-m", "engine", "pool", "stats", "--address", c.pool_address],
                capture_output=True, text=True, env=env(),
            )  # fmt: skip
            text = stats.stdout
            if '"blocks": 9' in text or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert '"blocks": 9' in text, text  # the prompt's 9 full blocks
        json.loads(text)
        pool = c.procs["pool"]
    assert pool.poll() is not None  # stopped with the cluster
