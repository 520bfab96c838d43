"""Chaos at the trace's real scale: Mooncake's conversation trace (whole conversations, prompts
of up to 28,641 tokens, 512-token blocks whose ids are kept, so a turn shares its earlier turns'
prefix as in the trace) replayed through the cluster's real processes (chaos_harness.py: the
pool service with DRAM and a full SSD tier, the router behind HTTP, a prefill and a decode
worker) while every role is SIGKILLed and restarted and KV layer messages are dropped, corrupted
and delayed. Every completed answer is compared with a colocated engine's answer to the same
prompt, computed beforehand with every prompt in one batch: the engine is batch-invariant
(docs/determinism.md), so the comparison is exact and any difference is a wrong answer.

    .venv/bin/python tests/chaos/trace_chaos.py --duration 1800 --seed 1

The default model serves the long turns with YaRN (``--rope-scaling``, 4 x its 8,192 positions);
what it answers there is not the point, that the cluster answers what the colocated engine
answers is. Clients walk the trace in its order (a shared cursor, round and round), 32 greedy
tokens per request with EOS ignored. The checks are chaos_harness.py's ``problems``.
"""

from __future__ import annotations

import gc
import itertools
import random
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from chaos_harness import Chaos, ChaosConfig, command_end, describe, summarize

YARN = '{"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 8192}'
CONVERSATIONS = 10  # the trace's first 10 whole conversations of turns <= 32,000 tokens
MAX_INPUT = 32000
OUT_TOKENS = 32
TRACE_CONFIG = ChaosConfig(
    duration_s=1800.0,
    clients=2,
    max_tokens=OUT_TOKENS,
    deadline_s=1500.0,  # a 28k prefill recomputed by the 1-thread decode worker fits
    kill_interval_s=(40.0, 80.0),
    # per layer message: a 28k prompt sends ~400 (chunks x layers), so ~1 in 3 of those faults
    kv_faults="drop=0.0005,corrupt=0.0005,delay=0.005,delay_s=0.3",
    ssd_mb=256,  # a disk of 256 MiB declared 1 GiB: it fills up
    dram_mb=256,
    start_timeout_s=300.0,
    engine_args=(
        "--max-model-len",
        "32768",
        "--rope-scaling",
        YARN,
        "--kv-cache-memory-gb",
        "2",
    ),  # fmt: skip
    threads=(2, 1),
    staging_mb=1024,
    router_args=("--ttft-slo", "1500"),  # the placement still runs; a 28k prompt is not refused
    memory_scale=2.5,
)


def trace_prompts(conversations: int = CONVERSATIONS, salt: int = 0) -> list[list[int]]:
    from engine.bench.trace import real_scale_conversations

    return real_scale_conversations(conversations, salt, MAX_INPUT)


def colocated_answers(prompts: list[list[int]], cfg: ChaosConfig) -> dict[int, str]:
    """Each prompt's greedy answer from one colocated engine with the workers' options, every
    prompt in one batch (the engine is batch-invariant: the bits of each request alone)."""
    from engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=cfg.max_tokens, temperature=0, ignore_eos=True)
    with LLM("default", max_model_len=32768, rope_scaling=YARN, kv_cache_memory_gb=3.0) as llm:
        outs = llm.generate(prompts, params)
    gc.collect()
    return {i: o.outputs[0].text for i, o in enumerate(outs)}


class TraceChaos(Chaos):
    def __init__(self, workdir: Path, keys_dir: str, cfg: ChaosConfig, prompts: list[list[int]],
                 reference: dict[int, str]) -> None:  # fmt: skip
        super().__init__(workdir, keys_dir, cfg)
        self.prompts = prompts
        self.colocated = dict(reference)
        self.exact_reference = True
        self._cursor = itertools.count()
        self._cursor_lock = threading.Lock()

    def body(self, i: int) -> dict:
        return {"model": "default", "prompt": self.prompts[i], "max_tokens": self.cfg.max_tokens,
                "temperature": 0, "ignore_eos": True}  # fmt: skip

    def next_prompt(self, rng: random.Random) -> int:
        with self._cursor_lock:
            return next(self._cursor) % len(self.prompts)

    def final_prompts(self) -> list[int]:
        """The three shortest prompts and the longest (its blocks may be in the pool)."""
        order = sorted(range(len(self.prompts)), key=lambda i: len(self.prompts[i]))
        return [*order[:3], order[-1]]

    def take_reference(self) -> None:
        """The colocated engine's answers are the reference; the cluster's first answer to the
        shortest prompt, before any fault, must already equal its own."""
        self.reference = dict(self.colocated)
        i = self.final_prompts()[0]
        r = self.ask(i)
        if r.kind != "identical":
            raise RuntimeError(f"the cluster's clean answer to prompt {i} is not the colocated "
                               f"engine's: {r}")  # fmt: skip


def run_trace_scenario(workdir: Path, keys_dir: str, cfg: ChaosConfig,
                       conversations: int = CONVERSATIONS) -> dict:  # fmt: skip
    prompts = trace_prompts(conversations, salt=cfg.seed)
    t0 = time.monotonic()
    reference = colocated_answers(prompts, cfg)
    reference_s = time.monotonic() - t0
    chaos = TraceChaos(workdir, keys_dir, cfg, prompts, reference)
    try:
        chaos.start()
        run = chaos.run()
    finally:
        left = chaos.stop()
    s = summarize(chaos, run, left)
    lengths = [len(p) for p in prompts]
    s["trace"] = {
        "conversations": conversations,
        "requests": len(prompts),
        "input_tokens_mean": round(sum(lengths) / len(lengths)),
        "input_tokens_max": max(lengths),
        "colocated_reference_s": round(reference_s, 1),
        "completed_by_length": _completed_by_length(chaos, lengths),
    }
    return s


def _completed_by_length(chaos: TraceChaos, lengths: list[int]) -> dict:
    """Identical answers per prompt-length band: long prompts completed too, not only short."""
    bands = {"<8k": 0, "8k-16k": 0, ">=16k": 0}
    for r in chaos.results:
        if r.kind == "identical":
            n = lengths[r.prompt]
            bands["<8k" if n < 8192 else "8k-16k" if n < 16384 else ">=16k"] += 1
    return bands


def describe_trace(cfg: ChaosConfig, s: dict) -> str:
    t = s["trace"]
    chaos = describe(cfg).replace(f", {cfg.clients} clients of greedy shared-prefix requests", "")
    return (
        f"the conversation trace at its real scale ({t['conversations']} conversations, "
        f"{t['requests']} requests, inputs {t['input_tokens_mean']:,} tokens on average, up to "
        f"{t['input_tokens_max']:,}; {cfg.max_tokens} greedy tokens each) replayed in its order by "
        f"{cfg.clients} clients under {chaos}; every answer against a colocated engine's"
    )


def main() -> int:
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of chaos")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--conversations", type=int, default=CONVERSATIONS)
    ap.add_argument("--hog", action="store_true", help="a process spinning on one core")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from engine.ipc.curve import generate_keys

    cfg = replace(TRACE_CONFIG, duration_s=args.duration, seed=args.seed, hog=args.hog)
    with tempfile.TemporaryDirectory() as tmp:
        keys = str(Path(tmp) / "keys")
        generate_keys(keys)
        t0 = time.monotonic()
        summary = run_trace_scenario(Path(tmp), keys, cfg, args.conversations)
    name = f"trace-seed{args.seed}" + ("-hog" if args.hog else "")
    return command_end(name, describe_trace(cfg, summary), summary, time.monotonic() - t0)


if __name__ == "__main__":
    sys.exit(main())
