"""Measure SmolLM2's prefill and decode-step times as a cluster worker runs them (one torch
thread, the worker's dtype) and fit the ``smollm2-cpu`` cost model's free constants
(engine/cluster/conductor/cost_model.py) to them. A few minutes on this machine.

    python profiling/measure_cost.py                 # --threads 1 --dtype auto
    python profiling/measure_cost.py --threads 2 --dtype float32

Prefill: one prompt of n random tokens with nothing cached, and n new tokens after p cached
ones (the prefix run first, prefix caching on); one output token; the median of ``--reps``.
The fit: t = overhead + FLOPs(n, p) / rate, least squares (FLOPs as the cost model counts them).
Decode step: a batch of b prompts run to 1 and to 17 output tokens (EOS ignored), the
difference over 16 steps. The fit: t = c0 + c1 b, c0 the weights' read (bandwidth) and the fixed
step overhead, c1 the cost model's per-request time. Prints the measurements beside
the fitted model's times and the constants to put in SMOLLM2_CPU.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import replace

import numpy as np
import torch

from engine import LLM, SamplingParams
from engine.cluster.conductor.cost_model import SMOLLM2_CPU

PREFILL = ((64, 0), (256, 0), (512, 0), (1024, 0), (256, 512), (64, 960))  # (new, cached)
DECODE = (1, 4, 16)  # batch sizes, 64-token prompts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    llm = LLM(dtype=args.dtype, max_num_batched_tokens=2048, num_blocks=512)
    dtype = llm.engine.cache.kv.dtype
    esize = torch.empty((), dtype=dtype).element_size()
    base = replace(
        SMOLLM2_CPU,
        kv_bytes_per_token=2 * 30 * 3 * 64 * esize,
        weight_bytes=134.5e6 * esize,
    )
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    def timed(prompts: list[list[int]], max_tokens: int) -> float:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, sp)
        return time.perf_counter() - t0

    timed([prompt(32)], 2)  # warm up
    t_start = time.perf_counter()
    pre: dict[tuple[int, int], float] = {}
    for n, p in PREFILL:
        times = []
        for _ in range(args.reps):
            if p:
                prefix = prompt(p)
                timed([prefix], 1)  # now cached (whole blocks: p is a multiple of 16)
                times.append(timed([prefix + prompt(n)], 1))
            else:
                times.append(timed([prompt(n)], 1))
        pre[(n, p)] = statistics.median(times)
    dec: dict[int, float] = {}
    for b in DECODE:
        steps = []
        for _ in range(max(1, args.reps - 1)):
            ps = [prompt(64) for _ in range(b)]
            steps.append((timed(ps, 17) - timed(ps, 1)) / 16)
        dec[b] = statistics.median(steps)

    # Prefill: t = overhead + flops / rate.
    def flops(n: int, p: int) -> float:
        m = base
        return m.layers * (m.attn_a * m.hidden * n * (n + p) + m.lin_b * m.hidden**2 * n)

    x = np.array([[1.0, flops(n, p)] for n, p in pre])
    y = np.array(list(pre.values()))
    (p_over, inv_rate), *_ = np.linalg.lstsq(x, y, rcond=None)
    rate = 1.0 / inv_rate
    # Decode: t = c0 + c1 * batch. The batch-independent part is reading the weights (plus
    # the fixed step overhead, assumed as before); the per-request part is the cost model's
    # decode_per_request_s (attention, sampling and bookkeeping per running request on a CPU).
    ctx = 64 + 8  # mean KV tokens of a request over its 16 measured steps
    xd = np.array([[1.0, float(b)] for b in DECODE])
    yd = np.array([dec[b] for b in DECODE])
    (c0, c1), *_ = np.linalg.lstsq(xd, yd, rcond=None)
    d_over = base.decode_overhead_s
    bw = base.weight_bytes / max(1e-4, float(c0) - d_over)
    fitted = replace(
        base,
        flops_per_s=float(rate),
        mfu=1.0,
        prefill_overhead_s=max(0.0, float(p_over)),
        hbm_bytes_per_s=float(bw),
        hbm_efficiency=1.0,
        decode_per_request_s=max(0.0, float(c1)),
    )
    took, load = time.perf_counter() - t_start, os.getloadavg()[0]
    print(f"dtype {dtype}, {args.threads} thread(s), median of {args.reps}; {took:.0f} s; "
          f"load average {load:.1f}\n")  # fmt: skip
    print("| prefill new tokens | cached tokens | measured (s) | fitted model (s) |")
    print("| ---: | ---: | ---: | ---: |")
    for (n, p), t in pre.items():
        print(f"| {n} | {p} | {t:.3f} | {fitted.prefill_s(n, p):.3f} |")
    print("\n| decode batch (64-token prompts) | measured step (ms) | fitted model (ms) |")
    print("| ---: | ---: | ---: |")
    for b, t in dec.items():
        print(f"| {b} | {t * 1e3:.1f} | {fitted.decode_step_s(b, b * ctx) * 1e3:.1f} |")
    f = fitted
    print("\nSMOLLM2_CPU constants (engine/cluster/conductor/cost_model.py):")
    print(f"    kv_bytes_per_token={f.kv_bytes_per_token}, weight_bytes={f.weight_bytes:.4g},")
    print(f"    flops_per_s={rate:.4g}, mfu=1.0, prefill_overhead_s={f.prefill_overhead_s:.4g},")
    print(f"    hbm_bytes_per_s={bw:.4g}, hbm_efficiency=1.0, "
          f"decode_per_request_s={f.decode_per_request_s:.4g}")  # fmt: skip
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
