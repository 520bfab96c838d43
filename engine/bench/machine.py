"""This machine's ceilings, measured in the run that quotes them (the offline and peer
benchmarks print their speeds beside these)."""

from __future__ import annotations

import time

import torch


def ceilings() -> dict:
    """This machine's ceilings, measured now: weight-streaming GEMV bandwidth (what batch-1 decode
    is bound by) and GEMM throughput (what prefill is bound by), fp32 and bf16."""

    def timed(a, b, reps=10) -> float:
        a @ b.T
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b.T
        return (time.perf_counter() - t0) / reps

    out = {}
    for dt in (torch.float32, torch.bfloat16):
        w = torch.randn(8192, 4096).to(dt)  # larger than the caches
        x = torch.randn(1, 4096).to(dt)
        out[f"gemv_gb_s_{dt}"] = w.numel() * w.element_size() / timed(x, w) / 1e9
        a = torch.randn(2048, 576).to(dt)
        b = torch.randn(1536, 576).to(dt)
        out[f"gemm_gflop_s_{dt}"] = 2 * 2048 * 576 * 1536 / timed(a, b) / 1e9
    return out
