"""Replay a Mooncake-format trace on a simulated cluster driven by the real Conductor.

    python profiling/simulate.py --prefill 8 --decode 8 --policy kvcentric --rejection predicted \\
        --speed 1.0 --json     # the Mooncake trace in data/traces/ unless --trace FILE
    python profiling/simulate.py --prefill 0 --prefill-groups 1 --stages 4 --decode 1 \\
        --long-prompts 16384,131072    # TTFT of long prompts on a prefill group

prints one JSON object (``--json``) or a table: TTFT mean/p50/p90 over completed requests, TBT p90
over all token intervals, completed and rejected requests, the prompt-token cache hit rate, the
share meeting both SLOs. The cost model (``--cost-model paper|smollm2-cpu``, constants in
engine/cluster/conductor/cost_model.py) gives every instance time; see engine/sim/simulator.py
for what is simulated. Deterministic for a given trace, configuration and ``--seed``.

This module is the command's body (``parse_args``, ``config_from``, ``main``);
profiling/simulate.py runs it.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import pstats
import sys

from engine.cluster.conductor.conductor import POLICIES
from engine.cluster.conductor.cost_model import COST_MODELS, get_cost_model
from engine.cluster.conductor.rejection import REJECTIONS
from engine.kvstore.eviction import POLICIES as EVICTIONS
from engine.sim.simulator import DEFAULT_CACHE_BLOCKS, SimConfig, Simulator
from engine.sim.trace import DEFAULT_TRACE, TraceRequest, load_trace


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake-format JSONL trace")
    p.add_argument("--prefill", type=int, default=8, help="single prefill instances")
    p.add_argument(
        "--prefill-groups", type=int, default=0, help="prefill groups (chunked pipeline "
        "parallelism) beside the single instances"
    )  # fmt: skip
    p.add_argument("--stages", type=int, default=2, help="instances (stages) per prefill group")
    p.add_argument(
        "--chunk-tokens", type=int, default=4096, help="a group cuts a prompt whose uncached "
        "part is longer into chunks of this many tokens"
    )  # fmt: skip
    p.add_argument(
        "--long-prompts", default="", metavar="LENGTHS", help="instead of a trace: one prompt "
        "of each length (comma-separated tokens, e.g. 16384,131072), alone in the cluster; "
        "prints each one's TTFT"
    )  # fmt: skip
    p.add_argument("--decode", type=int, default=8, help="decode instances")
    p.add_argument(
        "--colocated", type=int, default=0, help="N colocated instances instead (vLLM-like)"
    )
    p.add_argument("--policy", choices=POLICIES, default="kvcentric")
    p.add_argument("--rejection", choices=REJECTIONS, default="predicted")
    p.add_argument("--speed", type=float, default=1.0, help="replay speed (2.0: twice as fast)")
    p.add_argument("--ttft-slo", type=float, default=30.0, help="seconds ('inf': none)")
    p.add_argument("--tbt-slo", type=float, default=0.1, help="seconds ('inf': none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cost-model", choices=sorted(COST_MODELS), default="paper")
    p.add_argument("--cache-blocks", type=int, default=DEFAULT_CACHE_BLOCKS, help="per prefill")
    p.add_argument("--pool-blocks", type=int, default=0, help="global pool (0: none)")
    p.add_argument("--eviction", choices=EVICTIONS, default="lru")
    p.add_argument("--balancing-threshold", type=float, default=1.5)
    p.add_argument("--limit", type=int, default=0, help="first N requests only")
    p.add_argument("--duration", type=float, default=0.0, help="first S seconds of trace only")
    p.add_argument(
        "--oracle-output", action="store_true", help="the Conductor knows each output length"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--profile", action="store_true", help="cProfile the run (to stderr)")
    return p.parse_args(argv)


def config_from(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        prefill=args.prefill,
        prefill_groups=args.prefill_groups,
        stages=args.stages,
        chunk_tokens=args.chunk_tokens,
        decode=args.decode,
        colocated=args.colocated,
        policy=args.policy,
        rejection=args.rejection,
        ttft_slo_s=args.ttft_slo,
        tbt_slo_s=args.tbt_slo,
        balancing_threshold=args.balancing_threshold,
        seed=args.seed,
        cost_model=args.cost_model,
        cache_blocks=args.cache_blocks,
        pool_blocks=args.pool_blocks,
        eviction=args.eviction,
        oracle_output=args.oracle_output,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = config_from(args)
        if args.long_prompts:
            lengths = parse_lengths(args.long_prompts)
            requests = long_prompt_trace(lengths, get_cost_model(cfg.cost_model).block_tokens)
        else:
            requests = load_trace(args.trace, args.speed, args.limit, args.duration)
    except (ValueError, OSError) as e:
        print(f"simulate: {e}", file=sys.stderr)
        return 2
    sim = Simulator(cfg, requests)
    if args.profile:
        prof = cProfile.Profile()
        result = prof.runcall(sim.run)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
    else:
        result = sim.run()
    result["trace"] = args.trace if not args.long_prompts else "long prompts"
    result["speed"] = args.speed
    if args.long_prompts:  # each prompt's TTFT, by its length
        result["long_prompts"] = {
            str(r.input_len): sim.ttft.get(str(r.index), math.nan) for r in requests
        }
    if args.json:
        print(json.dumps(_finite(result), sort_keys=True))
        return 0
    if args.long_prompts:
        for length, ttft in result["long_prompts"].items():
            print(f"{int(length):>10,} tokens  TTFT {ttft:.3f} s")
        return 0
    for key in (
        "requests completed rejected rejected_at_arrival rejected_after_prefill ttft_mean_s "
        "ttft_p50_s ttft_p90_s tbt_p90_s slo_met cache_hit_rate copied_blocks wall_s"
    ).split():
        v = result[key]
        print(f"{key:>24}  {v:.4g}" if isinstance(v, float) else f"{key:>24}  {v}")
    return 0


LONG_PROMPT_GAP_S = 1e6  # between the prompts of --long-prompts: each finds the cluster idle


def parse_lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--long-prompts: comma-separated token counts, got {text!r}") from None
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--long-prompts: token counts >= 1, got {text!r}")
    return lengths


def long_prompt_trace(lengths: list[int], block_tokens: int) -> list[TraceRequest]:
    """One request per length, far apart, no shared prefix (fresh block ids), one output
    token: each prompt's TTFT is its prefill alone on an idle cluster."""
    out, next_id = [], 0
    for i, n in enumerate(lengths):
        blocks = -(-n // block_tokens)
        ids = tuple(range(next_id, next_id + blocks))
        next_id += blocks
        out.append(TraceRequest(i, i * LONG_PROMPT_GAP_S, n, 1, ids))
    return out


def _finite(obj):
    """JSON has no infinity: SLOs given as 'inf' print as null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    return obj
