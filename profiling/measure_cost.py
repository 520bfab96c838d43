"""Measure SmolLM2's prefill and decode-step times on this machine and fit the ``smollm2-cpu``
cost model's free constants (engine/cluster/cost_model.py) to them.

    python profiling/measure_cost.py

Prefill: one prompt of n random tokens, prefix caching off, one output token. Decode step: the
same batch run to 1 and to 33 output tokens (ignoring EOS); the difference over 32 steps. Prints
the measurements beside the model's times, and the effective FLOP/s and bandwidth that fit.

Status: its one run so far (load average 9 on the 2 cores, other agents' jobs) measured times
10-40x the README's quiet-machine figures and stopped at a 15-minute limit, so the smollm2-cpu
constants still come from the README's figures; rerun it on a quiet machine before refitting.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.cluster.cost_model import SMOLLM2_CPU as M  # noqa: E402


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int, reps: int = 2) -> float:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        llm.generate(prompts, sp)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    torch.set_num_threads(2)
    llm = LLM(enable_prefix_caching=False, max_num_batched_tokens=4096, dtype="float32")
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    timed(llm, [prompt(64)], 2, reps=1)  # warm up
    print("| prefill new tokens | measured (s) | model (s) |")
    print("| ---: | ---: | ---: |")
    pre = {}
    for n in (256, 1024, 2048):
        pre[n] = timed(llm, [prompt(n)], 1)
        print(f"| {n} | {pre[n]:.3f} | {M.prefill_s(n):.3f} |")
    print("\n| decode batch (128-token prompts) | measured step (ms) | model (ms) |")
    print("| ---: | ---: | ---: |")
    dec = {}
    for b in (1, 8, 32):
        ps = [prompt(128) for _ in range(b)]
        dec[b] = (timed(llm, ps, 33) - timed(llm, ps, 1)) / 32
        model = M.decode_step_s(b, b * 144)
        print(f"| {b} | {dec[b] * 1000:.1f} | {model * 1000:.1f} |")
    # Effective rates that would make the model match the largest measurements.
    flops = M.layers * (M.attn_a * M.hidden * 2048 * 2048 + M.lin_b * M.hidden**2 * 2048)
    print(f"\nprefill: {flops / (pre[2048] - M.prefill_overhead_s) / 1e9:.0f} GFLOP/s effective")
    print(f"decode batch 1: {M.weight_bytes / dec[1] / 1e9:.1f} GB/s effective weight reads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
