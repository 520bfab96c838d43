"""Prefix caching: TTFT of requests that share a long system prompt, cache on vs off.

    .venv/bin/python profiling/bench_prefix.py            # 32 requests, 1,024-token system prompt

Requests arrive one after another (each when the previous one has its first token), so TTFT is
the prefill time of what is not cached: with the cache on, only each request's own tail after
the first request has filled the cache. Prints TTFT p50/p90 and mean for both runs and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

from engine.bench.workload import WORDS
from engine.config import CacheConfig, EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def build_prompts(tok, n: int, system_len: int, user_len: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    system = " ".join(rng.choice(WORDS) for _ in range(system_len * 2))
    sys_ids = tok.encode(system, add_special_tokens=False)[:system_len]
    system = tok.decode(sys_ids)
    out = []
    for i in range(n):
        user = f"Question {i}: " + " ".join(rng.choice(WORDS) for _ in range(user_len))
        text = tok.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": user}],
            add_generation_prompt=True,
        )
        out.append(tok.encode(text, add_special_tokens=False))
    return out


def ttfts(engine: LLMEngine, prompts, max_tokens: int) -> list[float]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = []
    for p in prompts:
        t0 = time.perf_counter()
        rid = engine.add_request(p, params)
        first = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id == rid and first is None and o.outputs[0].token_ids:
                    first = time.perf_counter() - t0
        out.append(first)
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--user-len", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=4)
    args = ap.parse_args()

    rows = []
    for caching in (False, True):
        engine = LLMEngine(
            EngineConfig(
                model=args.model,
                dtype="float32",
                device="cpu",
                cache=CacheConfig(num_blocks=1024, enable_prefix_caching=caching),
            )
        )
        prompts = build_prompts(engine.tokenizer, args.num_requests, args.system_len, args.user_len)
        ttfts(engine, [prompts[0][:64]], 1)  # warm-up (not sharing the prefix)
        t = ttfts(engine, prompts, args.max_tokens)
        snap = engine.metrics_snapshot()
        rows.append((caching, t, snap.prefix_hits, snap.prefix_queries, len(prompts[0])))
    print(
        f"{args.num_requests} requests, system prompt {args.system_len} tokens, "
        f"prompt length {rows[0][4]} tokens, sequential arrivals"
    )
    print(
        f"{'prefix caching':16s} {'TTFT p50 ms':>12s} {'p90 ms':>9s} {'mean ms':>9s} "
        f"{'hit rate':>9s}"
    )
    for caching, t, hits, queries, _ in rows:
        print(
            f"{'on' if caching else 'off':16s} {1e3 * statistics.median(t):12.1f} "
            f"{1e3 * pct(t, 0.9):9.1f} {1e3 * statistics.mean(t):9.1f} "
            f"{hits / max(1, queries):9.1%}"
        )
    off, on = statistics.median(rows[0][1]), statistics.median(rows[1][1])
    print(f"TTFT p50 ratio, off / on: {off / on:.1f}x")


if __name__ == "__main__":
    main()
