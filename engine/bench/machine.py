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


def q8_gemm_gmac_s() -> tuple[float, str] | None:
    """The engine's W8A8 GEMM (engine/kernels/gemm_q8.py, its 8-bit integer products, the fastest
    the engine has on a CPU) measured now on a prefill-sized projection (2,048 rows of 576 to
    1,536): (GMAC/s, its path). None where the C kernels cannot be built."""
    from engine.kernels import native
    from engine.kernels.gemm_q8 import gemm_q8_native, pack_q8

    if native.library() is None:
        return None
    m, k, n = 2048, 576, 1536
    x, packed = torch.randn(m, k), pack_q8(torch.randn(n, k))
    gemm_q8_native(x, packed, n)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        gemm_q8_native(x, packed, n)
        best = min(best, time.perf_counter() - t0)
    return m * k * n / best / 1e9, native.gemm_q8_path()
