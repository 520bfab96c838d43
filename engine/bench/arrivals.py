"""When the serving benchmark (engine/bench/serve.py) sends each request, and sending them:
``arrival_delays`` is the schedule (all at once, a gamma process of --request-rate and
--burstiness, or a Mooncake trace's own timestamps), ``run_workload`` sends the requests through a
backend (engine/bench/backends.py) at those times under --max-concurrency."""

from __future__ import annotations

import asyncio
import time

import numpy as np
from tqdm import tqdm

from engine.bench.backends import RequestResult
from engine.bench.datasets import BenchRequest


def arrival_delays(args, requests: list[BenchRequest]) -> list[float]:
    """Seconds after the start at which each request is sent."""
    if args.dataset_name == "mooncake" and args.request_rate is None:
        t0 = requests[0].arrival_s or 0.0
        return [((r.arrival_s or 0.0) - t0) * args.mooncake_time_scale for r in requests]
    rate = args.request_rate if args.request_rate is not None else float("inf")
    if rate == float("inf"):
        return [0.0] * len(requests)
    rng = np.random.default_rng(args.seed)
    theta = 1.0 / (rate * args.burstiness)  # gamma with mean 1/rate; burstiness 1 = Poisson
    gaps = rng.gamma(shape=args.burstiness, scale=theta, size=len(requests))
    return list(np.cumsum(gaps) - gaps[0])


async def run_workload(backend, requests, delays, concurrency, show_progress) -> dict:
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    results = [RequestResult(input_len=len(r.prompt)) for r in requests]
    bar = tqdm(total=len(requests), disable=not show_progress, desc=backend.name, unit="req")
    q0, h0 = await backend.prefix_counters()
    start = time.perf_counter()

    async def one(i: int) -> None:
        wait = start + delays[i] - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        if sem is not None:
            await sem.acquire()
        try:
            results[i].start_s = time.perf_counter() - start
            await backend.request(requests[i], results[i])
        except Exception as exc:  # counted as a failed request, reported below
            results[i].error = f"{type(exc).__name__}: {exc}"
        finally:
            if sem is not None:
                sem.release()
            bar.update(1)

    await asyncio.gather(*(one(i) for i in range(len(requests))))
    duration = time.perf_counter() - start
    bar.close()
    q1, h1 = await backend.prefix_counters()
    return {
        "duration": duration,
        "results": results,
        "prefix_cache_hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
    }
