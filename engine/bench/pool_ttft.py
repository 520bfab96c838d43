"""TTFT of a long prompt whose blocks sit in the KV pool, against recomputing it
(``bench_pool.py ttft``).

For each dtype and repetition a fresh 2,048-token prompt is run once on a cold engine (TTFT of a
full recompute, its blocks saved to the pool), the device cache is reset, and the prompt runs
again: its blocks (all but the last, which must run to produce logits) load from the tier. For the
SSD tier the records' pages are flushed and dropped from the page cache first
(``posix_fadvise(DONTNEED)``), so the read comes from the disk. TTFT is the engine's own
(arrival to first token), medians over the repetitions.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

from engine.llm import LLM
from engine.sampling_params import SamplingParams

ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def add_parser(sub) -> None:
    p = sub.add_parser("ttft", help="TTFT of a long prompt loaded from DRAM / SSD vs recomputed")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument(
        "--kv-cache-dtypes", default="auto", help="comma list of --kv-cache-dtype values"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tiers", default="dram,ssd")
    p.add_argument(
        "--ssd-dir", default=None, help="directory for the SSD tier (default: a temp dir)"
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    p.set_defaults(func=cmd_ttft)


def drop_page_cache(directory: str) -> int:
    """Write back and drop the cached pages of every record under directory; returns files."""
    os.sync()
    n = 0
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


def ttft(out) -> float:
    m = out.metrics
    return m.first_token_time - m.arrival_time


def measure(
    tier: str, dtype: str, prompt_len: int, repeats: int, ssd_dir: str, kv_dtype: str = "auto"
) -> dict:
    """Median TTFT (s) recomputed and loaded from ``tier``, and the tokens loaded."""
    spec = "dram=2GiB" if tier == "dram" else f"ssd={ssd_dir}:4GiB"
    num_blocks = (prompt_len // 16 + 8) * 2
    cold, warm, loaded, load = [], [], [], []
    rng = random.Random(f"{tier}-{dtype}")
    with LLM(
        dtype=dtype, device="cpu", num_blocks=num_blocks, kv_pool=spec, kv_cache_dtype=kv_dtype
    ) as llm:
        vocab = llm.engine.model_config.vocab_size
        llm.generate(list(range(100, 164)), ONE_TOKEN)  # warm-up (allocator, threads)
        for _ in range(repeats):
            prompt = [rng.randrange(100, vocab) for _ in range(prompt_len)]
            cold.append(ttft(llm.generate(prompt, ONE_TOKEN)[0]))
            llm.engine.connector.flush()
            llm.reset_prefix_cache()
            if tier == "ssd":
                drop_page_cache(ssd_dir)
            out = llm.generate(prompt, ONE_TOKEN)[0]
            warm.append(ttft(out))
            loaded.append(out.metrics.kv_sources.get(tier, 0))
            load.append(out.metrics.kv_load_time)
            llm.reset_prefix_cache()
    return {
        "recompute_s": statistics.median(cold),
        "loaded_s": statistics.median(warm),
        "loaded_tokens": min(loaded),
        "load_s": statistics.median(load),
    }


def cmd_ttft(args: argparse.Namespace) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    tiers = [t for t in args.tiers.split(",") if t]
    rows = []
    combos = [(d, k) for d in args.dtypes.split(",") for k in args.kv_cache_dtypes.split(",")]
    for dtype, kv in combos:
        for tier in tiers:
            with tempfile.TemporaryDirectory(dir=args.ssd_dir) as d:
                t0 = time.perf_counter()
                r = measure(tier, dtype, args.prompt_len, args.repeats, d, kv)
                r.update(dtype=dtype, kv=kv, tier=tier, wall_s=time.perf_counter() - t0)
                rows.append(r)
                print(
                    f"  {dtype:9} kv {kv:8} {tier:5} recompute {r['recompute_s'] * 1e3:8.1f} ms  "
                    f"loaded {r['loaded_s'] * 1e3:7.1f} ms  ({r['loaded_tokens']} tokens in "
                    f"{r['load_s'] * 1e3:.1f} ms)",
                    flush=True,
                )
    target = {"dram": 20.0, "ssd": 8.0}
    print(f"\nTTFT of a {args.prompt_len}-token prompt, medians of {args.repeats} (CPU)")
    print(
        "| dtype | KV cache | tier | tokens loaded | KV load | recompute TTFT | loaded TTFT "
        "| speedup | target (fp32) |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        speed = r["recompute_s"] / r["loaded_s"]
        tgt = f">= {target[r['tier']]:.0f}x" if r["dtype"] == "float32" else ""
        print(
            f"| {r['dtype']} | {r['kv']} | {r['tier']} | {r['loaded_tokens']} | "
            f"{r['load_s'] * 1e3:.1f} ms | {r['recompute_s'] * 1e3:.0f} ms | "
            f"{r['loaded_s'] * 1e3:.0f} ms | {speed:.1f}x | {tgt} |"
        )
    by = {(r["dtype"], r["tier"], r["kv"]): r for r in rows}
    for (dtype, tier, kv), r in by.items():
        base = by.get((dtype, tier, "bfloat16"))
        if kv != "bfloat16" and base and r["load_s"] > 0:
            print(
                f"{dtype}, {tier}: the KV load with a {kv} cache "
                f"{base['load_s'] / r['load_s']:.2f}x as fast as with bfloat16 "
                f"({r['load_s'] * 1e3:.1f} against {base['load_s'] * 1e3:.1f} ms); "
                f"TTFT {base['loaded_s'] / r['loaded_s']:.2f}x"
            )
