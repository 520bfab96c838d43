"""Weight-only int8 matmul at decode sizes: the C kernel against the torch reference; at prefill
sizes, and a whole prefill, against dequantize + 16-bit GEMM (the path before int8_matmul_blocked).

    .venv/bin/python profiling/bench_int8.py [--rows 1 2 4 8] [--reps 10]
    .venv/bin/python profiling/bench_int8.py --prefill-rows 64 512 2048 [--reps 5]
    .venv/bin/python profiling/bench_int8.py --prompts 1024 2048 [--reps 3]
    .venv/bin/python profiling/bench_int8.py --prompts 1024 --int8-dtypes bfloat16 float32
    .venv/bin/python profiling/bench_int8.py --prefetch [--reps 60]

Decode sizes: runs every projection of the default model's 30 layers in turn (qkv 576->1728, o
576->576, gate_up 576->3072, down 1536->576: 120 int8 weights, 119 MB, more than the caches hold),
so the weights stream from memory as in a decode step. Prints ms per pass and the weight bandwidth,
best of --reps passes, alternating the two implementations. ``--prefill-rows``: each projection
shape of the default model (qkv 576->960, o 576->576, 576->1536, gate_up 576->3072, down
1536->576) at each row count, best of --reps, before and after alternating. ``--prompts``: the
prefill of a prompt of each length (one token generated, prefix caching off) by the default model
with the default dtype, with int8 weights before, and with int8 weights as the engine runs them
now, alternating; best of --reps. ``--int8-dtypes auto bfloat16 float32``: with int8 weights and
each of these activation dtypes instead of before and now. ``--prefetch``: the C row dots alone at
one activation row over the same 30 layers, int8 and bf16 weights, with gemv.h's prefetch and
without, in turn (a C harness, profiling/gemv_prefetch.c, built with the engine's compiler and
target flags; the prefetch is the AVX2 paths', so with AVX-512 both are the same code); best and
median of --reps passes. Set ENGINE_CPU_ISA in the environment to cap the CPU class.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

import torch
import torch.nn.functional as F

from engine.kernels.int8_matmul import int8_matmul_native, int8_matmul_ref
from engine.layers.quant import quantize_int8

# the module (engine.kernels.int8_matmul is also the name of the dispatching function)
int8_module = importlib.import_module("engine.kernels.int8_matmul")

SHAPES = [(1728, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # (out, in) per layer
PREFILL_SHAPES = [(960, 576), (576, 576), (1536, 576), (3072, 576), (576, 1536)]


def torch_isa() -> str:
    return torch.backends.cpu.get_cpu_capability()


def dequantize_gemm(x, qweight, scales):
    """The many-row path before int8_matmul_blocked: the whole weight in x's dtype, one GEMM."""
    return F.linear(x, qweight.to(x.dtype) * scales[:, None])


def bench_prefill_rows(rows_list: list[int], reps: int) -> None:
    torch.manual_seed(0)
    print(f"torch threads {torch.get_num_threads()}, torch {torch_isa()}")
    print(f"{'rows':>5} {'out x in':>11} {'before ms':>10} {'after ms':>9} {'speed-up':>9}")
    for rows in rows_list:
        for n, k in PREFILL_SHAPES:
            qw = quantize_int8(torch.randn(n, k) * 0.05, torch.bfloat16)
            x = torch.randn(rows, k).bfloat16()
            best = {dequantize_gemm: float("inf"), int8_matmul_native: float("inf")}
            for _ in range(reps):
                for fn in best:
                    start = time.perf_counter()
                    fn(x, qw.qweight, qw.scales)
                    best[fn] = min(best[fn], time.perf_counter() - start)
            before, after = best[dequantize_gemm], best[int8_matmul_native]
            print(f"{rows:>5} {f'{n}x{k}':>11} {before * 1e3:>10.2f} {after * 1e3:>9.2f} "
                  f"{before / after:>8.2f}x", flush=True)  # fmt: skip


def bench_prompts(lengths: list[int], reps: int, int8_dtypes: list[str] | None) -> None:
    from engine import LLM, SamplingParams
    from engine.config import EngineConfig
    from engine.core.device_resolution import resolved_dtype

    default = LLM(enable_prefix_caching=False, max_num_batched_tokens=max(lengths))
    dtype = resolved_dtype(EngineConfig())
    print(f"torch threads {torch.get_num_threads()}, torch {torch_isa()}, default dtype {dtype}")
    blocked = int8_module.int8_matmul_blocked
    params = SamplingParams(max_tokens=1, temperature=0.0)
    g = torch.Generator().manual_seed(0)
    runs = {"default": (default, blocked)}
    if int8_dtypes:  # int8 weights with each activation dtype, as the engine runs them now
        for dt in int8_dtypes:
            llm = LLM(dtype=dt, quantization="int8", enable_prefix_caching=False,
                      max_num_batched_tokens=max(lengths))  # fmt: skip
            runs[f"int8 {dt}"] = (llm, blocked)
    else:
        int8 = LLM(quantization="int8", enable_prefix_caching=False,
                   max_num_batched_tokens=max(lengths))  # fmt: skip
        runs["int8 before"] = (int8, dequantize_gemm)
        runs["int8 now"] = (int8, blocked)
    print(f"{'prompt':>7} " + " ".join(f"{name + ' ms':>14}" for name in runs))
    for length in lengths:
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(reps):
            for name, (llm, many_rows) in runs.items():
                int8_module.int8_matmul_blocked = many_rows
                ids = torch.randint(100, 40000, (length,), generator=g).tolist()
                start = time.perf_counter()
                llm.generate([ids], params)
                best[name] = min(best[name], time.perf_counter() - start)
        int8_module.int8_matmul_blocked = blocked
        print(f"{length:>7} " + " ".join(f"{best[n] * 1e3:>14.1f}" for n in runs), flush=True)


def bench_prefetch(reps: int) -> None:
    import os
    import subprocess
    import tempfile

    from engine.kernels import native

    cc = native.compiler()
    if cc is None:
        raise SystemExit("--prefetch needs a C compiler (cc or $CC)")
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemv_prefetch.c")
    include = os.path.dirname(os.path.abspath(native.__file__))
    flags = [*native.compile_flags(), f"-I{include}"]
    flags = [f for f in flags if f not in ("-shared", "-fPIC")]
    with tempfile.TemporaryDirectory() as tmp:
        objs = []
        for name, defines in (
            ("default", ["-DPASS=pass_default"]),
            ("off", ["-DPASS=pass_off", "-DGEMV_PF_BYTES=0"]),
            ("main", ["-DMAIN"]),
        ):
            obj = os.path.join(tmp, f"{name}.o")
            subprocess.run([cc, *flags, *defines, "-c", src, "-o", obj], check=True)
            objs.append(obj)
        exe = os.path.join(tmp, "gemv_prefetch")
        subprocess.run([cc, "-fopenmp", *objs, "-o", exe, "-lm"], check=True)
        threads = torch.get_num_threads()
        subprocess.run([exe, str(reps), str(threads)], check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--prefill-rows", type=int, nargs="+", help="prefill-sized matmuls instead")
    ap.add_argument("--prompts", type=int, nargs="+", help="prefills of these lengths instead")
    ap.add_argument("--int8-dtypes", nargs="+", help="--prompts: int8 with these dtypes (auto, "
                    "bfloat16, float32) instead of the many-row path before and now")  # fmt: skip
    ap.add_argument("--prefetch", action="store_true", help="the C row dots with gemv.h's "
                    "prefetch and without, at one row, int8 and bf16, in a C harness")  # fmt: skip
    args = ap.parse_args()
    if args.prefetch:
        bench_prefetch(args.reps)
        return 0
    if args.prefill_rows:
        bench_prefill_rows(args.prefill_rows, args.reps)
        return 0
    if args.prompts:
        bench_prompts(args.prompts, args.reps, args.int8_dtypes)
        return 0
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
