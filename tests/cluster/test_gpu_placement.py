"""``engine cluster`` on GPUs: which GPU and memory share each worker gets (a pure decision on the
number of visible GPUs), and the worker command lines the launcher builds from it. No GPU is
needed: the GPU count is an argument."""

from __future__ import annotations

import argparse

import pytest

import engine.cluster.launcher as launcher
from engine.cli.cluster import add_cluster_commands, worker_argv, worker_gpus
from engine.cli.engine_options import add_engine_options
from engine.cluster.gpu_placement import WorkerGpu, place_workers, worker_gpu_argv


def cluster_args(*words: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_cluster_commands(p.add_subparsers(dest="command"), add_engine_options)
    return p.parse_args(["cluster", *words])


def devices(placed: list[WorkerGpu] | None) -> list[tuple[str, float]] | None:
    return None if placed is None else [(w.device, w.gpu_memory_utilization) for w in placed]


def test_one_worker_per_gpu_round_robin_keeps_the_whole_share():
    assert devices(place_workers(2, 2, "auto", 0.85)) == [("cuda:0", 0.85), ("cuda:1", 0.85)]
    assert devices(place_workers(4, 4, "cuda", 0.9)) == [(f"cuda:{i}", 0.9) for i in range(4)]
    # more GPUs than workers: the first ones
    assert devices(place_workers(2, 8, "auto", 0.9)) == [("cuda:0", 0.9), ("cuda:1", 0.9)]


def test_workers_sharing_a_gpu_split_its_share():
    # 2 prefill + 2 decode on 2 GPUs: each GPU holds one of each, half the share each.
    assert devices(place_workers(4, 2, "auto", 0.9)) == [
        ("cuda:0", 0.45), ("cuda:1", 0.45), ("cuda:0", 0.45), ("cuda:1", 0.45)
    ]  # fmt: skip
    # 3 workers on 2 GPUs: cuda:0 holds two, cuda:1 one.
    assert devices(place_workers(3, 2, "auto", 0.9)) == [
        ("cuda:0", 0.45), ("cuda:1", 0.9), ("cuda:0", 0.45)
    ]  # fmt: skip
    # --gpus 1: all on cuda:0; rounded down so the parts never sum past the share.
    placed = place_workers(3, 4, "auto", 0.85, gpus=1)
    assert devices(placed) == [("cuda:0", 0.2833)] * 3
    assert sum(w.gpu_memory_utilization for w in placed) <= 0.85
    # --device cuda:N: all on N
    assert devices(place_workers(2, 4, "cuda:3", 0.8)) == [("cuda:3", 0.4)] * 2


def test_the_cpu_gets_no_placement():
    assert place_workers(2, 0, "auto", 0.85) is None
    assert place_workers(2, 4, "cpu", 0.85) is None


@pytest.mark.parametrize(
    "args, match",
    [
        ((2, 0, "cuda", 0.85, None), "no CUDA GPU is visible"),
        ((2, 2, "cuda:2", 0.85, None), "only 2 GPU"),
        ((2, 2, "auto", 0.85, 3), "--gpus 3: only 2 GPU"),
        ((2, 0, "auto", 0.85, 1), "--gpus 1 needs CUDA GPUs"),
        ((2, 4, "cuda:1", 0.85, 2), "give one or the other"),
        ((2, 2, "auto", 0.85, 0), "--gpus must be >= 1"),
        ((30000, 1, "auto", 0.5, None), "leaves each nothing"),
    ],
)
def test_what_cannot_be_placed_is_refused(args, match):
    with pytest.raises(ValueError, match=match):
        place_workers(*args)


def test_worker_gpu_argv():
    assert WorkerGpu("cuda:1", 0.45).argv() == [
        "--device", "cuda:1", "--gpu-memory-utilization", "0.45"
    ]  # fmt: skip
    assert WorkerGpu("cuda:0", 0.2833).argv()[-1] == "0.2833"


class _FakeChild:
    """What the launcher starts, recorded instead of run."""

    started: list[list[str]] = []

    def __init__(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        _FakeChild.started.append(cmd)
        self.proc = self
        self.pid = 2**22 + len(_FakeChild.started)  # no real process, no staging file

    def poll(self) -> int:
        return 0

    def wait(self, timeout=None) -> int:
        return 0

    def exited(self):
        return None


def launched(monkeypatch, words: list[str], visible: int) -> dict[str, list[str]]:
    """The command line of each worker ``engine cluster WORDS`` starts with ``visible`` GPUs."""
    from engine.cluster.router.router import Router

    _FakeChild.started = []
    monkeypatch.setattr(launcher, "_Child", _FakeChild)
    monkeypatch.setattr(Router, "wait_for_workers", lambda self, *a, **kw: None)
    args = cluster_args(*words)
    gpus = worker_gpus(args, visible)
    cluster = launcher.Cluster(
        args.prefill,
        args.decode,
        worker_args=worker_argv(args, placed=gpus is not None),
        worker_gpus=gpus,
    )
    cluster.stop()
    return {cmd[cmd.index("--worker-id") + 1]: cmd for cmd in _FakeChild.started}


def option(cmd: list[str], flag: str) -> list[str]:
    return [cmd[i + 1] for i, word in enumerate(cmd) if word == flag]


def test_the_launcher_gives_each_worker_its_gpu(monkeypatch):
    cmds = launched(monkeypatch, ["--prefill", "2", "--decode", "1",
                                  "--gpu-memory-utilization", "0.9"], visible=2)  # fmt: skip
    assert {w: option(c, "--device") for w, c in cmds.items()} == {
        "prefill-0": ["cuda:0"], "prefill-1": ["cuda:1"], "decode-0": ["cuda:0"]
    }  # fmt: skip
    assert {w: option(c, "--gpu-memory-utilization") for w, c in cmds.items()} == {
        "prefill-0": ["0.45"], "prefill-1": ["0.9"], "decode-0": ["0.45"]
    }  # fmt: skip


def test_the_launcher_puts_all_on_one_gpu_or_keeps_the_cpu(monkeypatch):
    cmds = launched(monkeypatch, ["--gpus", "1"], visible=4)
    for cmd in cmds.values():
        assert option(cmd, "--device") == ["cuda:0"]
        assert option(cmd, "--gpu-memory-utilization") == ["0.425"]
    cmds = launched(monkeypatch, ["--device", "cpu"], visible=4)
    for cmd in cmds.values():
        assert option(cmd, "--device") == ["cpu"]
        assert option(cmd, "--gpu-memory-utilization") == []
    cmds = launched(monkeypatch, [], visible=0)  # auto on a CPU machine: as before
    for cmd in cmds.values():
        assert option(cmd, "--device") == [] and option(cmd, "--gpu-memory-utilization") == []


def test_worker_ids_get_their_options():
    # profiling/gpu_e2e.py's 1 prefill + 1 decode on one GPU
    assert worker_gpu_argv(1, 1, 1, "cuda", 0.85, 1) == {
        "prefill-0": ["--device", "cuda:0", "--gpu-memory-utilization", "0.425"],
        "decode-0": ["--device", "cuda:0", "--gpu-memory-utilization", "0.425"],
    }
    assert worker_gpu_argv(1, 1, 0, "cpu", 0.85) is None
