"""The most products per second this CPU class's vector instructions give: each mix a kernel's
inner step uses, alone, on every thread.

    .venv/bin/python profiling/bench_product_peak.py
    ENGINE_CPU_ISA=avx2 .venv/bin/python profiling/bench_product_peak.py

Builds profiling/product_peak.c with the engine's compiler and target flags (under
``ENGINE_CPU_ISA=avx2`` it is -march=x86-64-v3, so only the AVX2 mixes run) and prints a table:
products per chain step, GMAC/s at ``--threads`` threads (default torch's), and the ratio to a
float32 FMA in ymm. These are ceilings no kernel reaches (a kernel also loads, converts and
stores); beside a kernel's measured rate they say how far it is from its instructions' limit,
and beside a workload's multiply-accumulates (engine/bench/floor.py) how fast any engine with
those products could be (docs/benchmarks.md, "The AVX2 trace over an int8 cache").
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

from engine.cpu_isa import this_cpu  # before torch: ENGINE_CPU_ISA caps it (engine/cpu_isa.py)

HERE = os.path.dirname(os.path.abspath(__file__))


def build(tmp: str) -> str:
    from engine.kernels import native

    cc = native.compiler()
    if cc is None:
        raise SystemExit("bench_product_peak.py needs a C compiler (cc or $CC)")
    flags = [f for f in native.compile_flags() if f not in ("-shared", "-fPIC")]
    exe = os.path.join(tmp, "product_peak")
    src = os.path.join(HERE, "product_peak.c")
    subprocess.run([cc, *flags, "-fopenmp", src, "-o", exe], check=True)
    return exe


def main() -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=20_000_000, help="loop steps per thread")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    if args.iterations < 1 or args.threads < 1:
        ap.error("--iterations and --threads must be at least 1")
    print(this_cpu().describe(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [build(tmp), str(args.iterations), str(args.threads)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    rows = [line.split("\t") for line in out.strip().splitlines()]
    base = float(rows[0][2])
    print(f"\n{args.threads} threads, {args.iterations} steps of 12 chains each")
    print("| mix | products per step | GMAC/s | vs fma f32 ymm |")
    print("| --- | ---: | ---: | ---: |")
    for name, products, rate in rows:  # (a run too short to time gives no ratio)
        ratio = f"{float(rate) / base:.2f}x" if base > 0 else "-"
        print(f"| {name} | {products} | {float(rate):.1f} | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
