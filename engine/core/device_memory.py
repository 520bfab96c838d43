"""The engine's GPU: made current before anything touches CUDA, and its memory as this process
sees it (the numbers engine/kvcache/kv_budget.py sizes the KV cache from).

``--device cuda:N`` makes N the current CUDA device (``torch.cuda.set_device``) first thing in
``LLMEngine``: Triton launches on the current device whatever its tensors' device is, and
torch's ``"cuda"`` means the current one. ``auto`` and ``cuda`` keep the current device (0 unless
the process set another). ``MemoryBaseline`` is taken at that moment, before the weights load,
so that what the process allocates outside torch later (cuBLAS workspaces, Triton modules) is
counted as its own and what other processes hold on the same GPU is not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kvcache.kv_budget import DeviceMemory


def select_device(device: torch.device) -> torch.device:
    """Make ``device`` the current CUDA device (a no-op on a CPU); returns it with its index."""
    if device.type != "cuda":
        return device
    if device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    count = torch.cuda.device_count()
    if device.index >= count:
        raise ValueError(f"device cuda:{device.index} does not exist: {count} GPU(s) visible")
    torch.cuda.set_device(device.index)
    return device


@dataclass(frozen=True)
class MemoryBaseline:
    """The device's free memory and torch's reserved memory before the engine allocated."""

    free: int
    reserved: int

    @classmethod
    def take(cls, device: torch.device) -> MemoryBaseline | None:
        if device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(device)
        return cls(free=free, reserved=torch.cuda.memory_reserved(device))

    def measure(self, device: torch.device, reserve: int) -> DeviceMemory:
        """The device's memory now, this process's share of it since the baseline: torch's
        reserved memory plus whatever else the free memory lost beyond torch's growth."""
        torch.cuda.empty_cache()  # the loader's temporaries: not ours to keep
        free, total = torch.cuda.mem_get_info(device)
        reserved = torch.cuda.memory_reserved(device)
        non_torch = max(0, (self.free - free) - (reserved - self.reserved))
        return DeviceMemory(total=total, free=free, used=reserved + non_torch, reserve=reserve)
