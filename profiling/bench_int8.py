"""Weight-only int8 matmul at decode sizes: the C kernel against the torch reference.

    .venv/bin/python profiling/bench_int8.py [--rows 1 2 4 8] [--reps 10]

Runs every projection of the default model's 30 layers in turn (qkv 576->1728, o 576->576,
gate_up 576->3072, down 1536->576: 120 int8 weights, 119 MB, more than the caches hold), so the
weights stream from memory as in a decode step. Prints ms per pass and the weight bandwidth, best
of --reps passes, alternating the two implementations.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from engine.kernels.int8_matmul import int8_matmul_native, int8_matmul_ref
from engine.layers.quant import quantize_int8

SHAPES = [(1728, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # (out, in) per layer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch.manual_seed(0)
    weights = [quantize_int8(torch.randn(n, k) * 0.05, torch.bfloat16) for n, k in SHAPES]
    total = sum(n * k for n, k in SHAPES)
    print(f"torch threads {torch.get_num_threads()}, {len(weights)} weights, {total / 1e6:.0f} MB")
    print(f"{'rows':>5} {'reference ms':>13} {'GB/s':>6} {'C ms':>8} {'GB/s':>6} {'speed-up':>9}")
    for rows in args.rows:
        xs = {k: torch.randn(rows, k).bfloat16() for _, k in SHAPES[:4]}
        best = {int8_matmul_ref: float("inf"), int8_matmul_native: float("inf")}
        for _ in range(args.reps):
            for fn in best:
                start = time.perf_counter()
                for qw in weights:
                    fn(xs[qw.qweight.shape[1]], qw.qweight, qw.scales)
                best[fn] = min(best[fn], time.perf_counter() - start)
        ref, nat = best[int8_matmul_ref], best[int8_matmul_native]
        print(f"{rows:>5} {ref * 1e3:>13.2f} {total / ref / 1e9:>6.1f} {nat * 1e3:>8.2f} "
              f"{total / nat / 1e9:>6.1f} {ref / nat:>8.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
