"""Which GPU each worker of ``engine cluster`` runs on, and its share of that GPU's memory.

A pure decision (docs/cluster.md): with the engine device ``auto`` or ``cuda`` and GPUs visible,
the workers go round-robin over the first ``gpus`` visible GPUs (default: all of them), prefill
workers first, then decode, so one prefill and one decode worker on two GPUs get one each;
``--device cuda:N`` puts every worker on GPU N. Each GPU's ``gpu_memory_utilization`` (the
cluster's share of it) is split evenly among the workers placed there, each worker getting its
part as its own ``--gpu-memory-utilization`` (rounded down, so the parts never sum to more):
``--gpus 1`` with 2 workers and 0.9 gives each worker 0.45 of cuda:0. On a CPU (``--device
cpu``, or ``auto`` with no GPU visible) workers get no device and keep the engine options as
given. vLLM and SGLang likewise give each process one device (SGLang's ``--base-gpu-id``,
``--gpu-id-step``) and make ``--gpu-memory-utilization`` / ``--mem-fraction-static`` the
process's share of its GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerGpu:
    """One worker's GPU and its share of that GPU's total memory."""

    device: str  # "cuda:I"
    gpu_memory_utilization: float

    def argv(self) -> list[str]:
        """The worker's command-line options that say so."""
        util = f"{self.gpu_memory_utilization:.4f}".rstrip("0").rstrip(".")
        return ["--device", self.device, "--gpu-memory-utilization", util]


def place_workers(
    num_workers: int, visible_gpus: int, device: str, utilization: float, gpus: int | None = None
) -> list[WorkerGpu] | None:
    """Each worker's GPU and memory share, in start order (prefill workers, then decode), or
    None where the workers run on the CPU. ValueError for a device or ``gpus`` that cannot be
    honoured, naming the option and the GPUs visible."""
    if gpus is not None and gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    if device == "cpu" or (device == "auto" and visible_gpus == 0):
        if gpus is not None:
            raise ValueError(f"--gpus {gpus} needs CUDA GPUs; the workers run on the CPU here")
        return None
    if visible_gpus == 0:
        raise ValueError(f"--device {device}: no CUDA GPU is visible")
    if device.startswith("cuda:"):
        index = int(device.removeprefix("cuda:"))
        if index >= visible_gpus:
            raise ValueError(f"--device {device}: only {visible_gpus} GPU(s) visible")
        if gpus not in (None, 1):
            raise ValueError(f"--gpus {gpus} with --device {device}: give one or the other")
        indices = [index]
    else:
        count = visible_gpus if gpus is None else gpus
        if count > visible_gpus:
            raise ValueError(f"--gpus {gpus}: only {visible_gpus} GPU(s) visible")
        indices = list(range(count))
    chosen = [indices[i % len(indices)] for i in range(num_workers)]
    share = {g: math.floor(utilization / chosen.count(g) * 1e4) / 1e4 for g in set(chosen)}
    for g, part in share.items():
        if part <= 0:
            raise ValueError(
                f"--gpu-memory-utilization {utilization} split over {chosen.count(g)} workers "
                f"on cuda:{g} leaves each nothing"
            )
    return [WorkerGpu(f"cuda:{g}", share[g]) for g in chosen]


def worker_gpu_argv(
    prefill: int,
    decode: int,
    visible_gpus: int,
    device: str,
    utilization: float,
    gpus: int | None = None,
    stage_ids: list[str] | None = None,
) -> dict[str, list[str]] | None:
    """``place_workers`` for the launcher's workers (``prefill-I``, then the prefill groups'
    ``stage_ids``, then ``decode-I``): each worker id's ``--device cuda:I
    --gpu-memory-utilization U``, or None on the CPU."""
    ids = [f"prefill-{i}" for i in range(prefill)] + list(stage_ids or [])
    ids += [f"decode-{i}" for i in range(decode)]
    placed = place_workers(len(ids), visible_gpus, device, utilization, gpus)
    if placed is None:
        return None
    return {worker_id: gpu.argv() for worker_id, gpu in zip(ids, placed, strict=True)}
