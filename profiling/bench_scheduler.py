"""Scheduler overhead: the share of step time spent outside the model forward and sampling,
with N sequences decoding together.

    .venv/bin/python profiling/bench_scheduler.py          # 64 running sequences

Steady-state decode steps only (after every prompt is prefilled). "schedule" covers the
scheduler, block allocation and input preparation; "process" covers detokenization, stop checks
and building outputs.
"""

from __future__ import annotations

import argparse

from engine.bench.workload import chat_prompts
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.llm_engine import LLMEngine
from engine.core.metrics import StepTimes
from engine.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype="float32",
            device="cpu",
            cache=CacheConfig(kv_cache_memory_gb=4.0),
            scheduler=SchedulerConfig(max_num_seqs=args.num_seqs, max_num_batched_tokens=4096),
        )
    )
    prompts = chat_prompts(engine.tokenizer, args.num_seqs, args.prompt_len, args.prompt_len)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    while len(engine.scheduler.running) < args.num_seqs or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    engine.step_times = StepTimes()
    for _ in range(args.steps):
        engine.step()
    t = engine.step_times
    print(
        f"{args.num_seqs} sequences decoding, {t.steps} steps, "
        f"{1e3 * t.total / t.steps:.1f} ms per step"
    )
    for name in ("schedule", "forward", "sample", "process"):
        v = getattr(t, name)
        print(f"  {name:9s} {1e3 * v / t.steps:8.2f} ms  {v / t.total:6.1%}")
    overhead = t.schedule + t.process
    print(
        f"scheduler + bookkeeping overhead (outside forward and sampling): "
        f"{overhead / t.total:.1%} of step time"
    )


if __name__ == "__main__":
    main()
