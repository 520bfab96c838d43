"""The step timer's clock (engine/core/metrics.py StepTimes splits each step with it)."""

from __future__ import annotations

import time

import torch


def step_clock(device: torch.device) -> float:
    """time.perf_counter() once the work queued on ``device`` is done, where the step timer
    splits a step: on CUDA a torch.cuda.synchronize (else the forward's GPU time would be booked
    to whatever waits for it next), on the CPU nothing."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
