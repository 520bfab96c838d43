"""``engine cluster`` as a new user types it (the README's command, no other option than the
port) serves a completion and stops every process on SIGTERM; a worker or pool service that
exits at start-up makes the launcher stop the others and exit non-zero at once, naming the child
and the last lines of its stderr, instead of waiting out ``--worker-timeout``."""

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

from engine.ipc.ports import free_port


def shm_files() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def stop(proc: subprocess.Popen, children: list[psutil.Process]) -> None:
    for c in children:
        if c.is_running():
            c.kill()
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def test_cluster_command_with_its_defaults_serves():
    port = free_port()
    before = shm_files()
    cmd = [sys.executable, "-m", "engine", "cluster", "--prefill", "1", "--decode", "1",
           "--port", str(port)]  # fmt: skip
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    children: list[psutil.Process] = []
    try:
        wait_healthy(url, proc)
        children = psutil.Process(proc.pid).children(recursive=True)
        body = {"model": "default", "prompt": "The capital of France is", "max_tokens": 8,
                "temperature": 0}  # fmt: skip
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
        assert "Paris" in r.json()["choices"][0]["text"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"left running: {alive}"
        assert shm_files() <= before, f"left in /dev/shm: {shm_files() - before}"
    finally:
        stop(proc, children)


def tagged(tag: str) -> list[psutil.Process]:
    """The processes whose environment carries ``tag`` (what a launch started)."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("ENGINE_TEST_LAUNCH") == tag:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


@pytest.mark.parametrize(
    "bad, who, quoted",
    [
        (["--kv-pool", "bogus=1GiB"], "worker", "kv_pool part 'bogus=1GiB'"),
        (["--pool-service", "dram=lots"], "the pool service", "--dram 'lots' is not a size"),
    ],
    ids=["worker", "pool-service"],
)
def test_a_child_that_exits_at_start_up_fails_the_launch_at_once(bad, who, quoted):
    """With a start timeout of 600 s the launcher still exits within a minute (in ~5 s here:
    the time a worker takes to import torch and read its options), code 1, naming the child
    and quoting its error; no child is left running."""
    cmd = [sys.executable, "-m", "engine", "cluster", "--prefill", "1", "--decode", "1",
           "--port", str(free_port()), "--worker-timeout", "600", *bad]  # fmt: skip
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    env = dict(os.environ, ENGINE_TEST_LAUNCH=tag)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        stop(proc, tagged(tag))
        pytest.fail("the launcher waited for a child that had exited")
    assert proc.returncode == 1, err
    last = err.strip().splitlines()
    assert any("engine cluster did not start" in line and who in line for line in last), err
    assert any(line.startswith("    ") and quoted in line for line in last), err
    _, alive = psutil.wait_procs(tagged(tag), timeout=10)
    assert not alive, f"left running: {alive}"


def test_a_groups_stages_start_without_the_pool_the_other_workers_use():
    """--pool-service (or --kv-pool) goes to every worker but a prefill group's stages, which run
    without a KV pool (a stage refuses one at start)."""
    from types import SimpleNamespace

    from engine.cluster.launcher import Cluster

    launcher = SimpleNamespace(
        router=SimpleNamespace(address="tcp://127.0.0.1:1"),
        kv_transport="shm",
        threads=1,
        worker_args=["--kv-pool", "tcp://127.0.0.1:2", "--dtype", "float32", "--kv-pool=x"],
        worker_gpus={},
        stage_args={"group-0-stage-1": ["--group", "group-0", "--stage", "1/2"]},
    )
    stage = Cluster.worker_command(launcher, "prefill", "group-0-stage-1")
    alone = Cluster.worker_command(launcher, "prefill", "prefill-0")
    assert "--kv-pool" not in stage and "--kv-pool=x" not in stage
    assert stage[-6:] == ["--dtype", "float32", "--group", "group-0", "--stage", "1/2"]
    assert alone[-5:] == ["--kv-pool", "tcp://127.0.0.1:2", "--dtype", "float32", "--kv-pool=x"]
