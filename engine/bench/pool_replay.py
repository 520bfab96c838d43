"""The KV pool's trace replay (``bench_pool.py replay``): the hit rates a trace in Mooncake's
format would get from the store's eviction policies, with a capacity-only index (no model, no
data; capacity in the trace's own blocks, 512 tokens each, the last block of a prompt partial).

Per request: the leading run of its blocks that the cache holds is a hit (as the engine's prefix
match), then every block is accessed or inserted. Token hit rates weight each block by its
length (``input_length``).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import NamedTuple

from engine.kvstore.eviction import POLICIES, make_policy
from engine.sim.trace import DEFAULT_TRACE

TRACE_BLOCK_TOKENS = 512
# The figures of data/traces/mooncake/README.md (token hit rates, LRU) for this trace.
README_FIGURES = {"lru": {"10000": 0.215, "50000": 0.362, "inf": 0.374}}


def add_parser(sub) -> None:
    rp = sub.add_parser("replay", help="hit rates of a Mooncake-format trace per policy/capacity")
    rp.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake-format JSONL")
    rp.add_argument("--blocks", default="1000,10000,50000,inf", help="capacities, in trace blocks")
    rp.add_argument("--policy", default=",".join(POLICIES))
    rp.add_argument("--json", action="store_true", help='print {"lru": {"1000": 0.04, ...}, ...}')
    rp.set_defaults(func=cmd_replay)


class TraceRequest(NamedTuple):
    hash_ids: list[int]
    input_length: int


class HitRates(NamedTuple):
    tokens: float
    blocks: float
    evictions: int


class CapacityIndex:
    """The store's index without data: which keys a tier of ``capacity`` blocks holds, evicting
    by the same policy classes the tiers use."""

    def __init__(self, capacity: float, policy: str) -> None:
        self.capacity = capacity
        self.policy = make_policy(policy)
        self.evictions = 0

    def __contains__(self, key) -> bool:
        return key in self.policy

    def access_or_insert(self, key, position: int) -> None:
        if key in self.policy:
            self.policy.on_access(key)
            return
        if len(self.policy) >= self.capacity:
            victim = self.policy.victim()
            self.policy.on_remove(victim)
            self.evictions += 1
        self.policy.on_insert(key, position)


def load_trace(path: str) -> list[TraceRequest]:
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            r = json.loads(line)
            ids, length = r["hash_ids"], r["input_length"]
            if len(ids) != math.ceil(length / TRACE_BLOCK_TOKENS):
                raise ValueError(f"{path}:{n}: {len(ids)} hash_ids for input_length {length}")
            out.append(TraceRequest(ids, length))
    return out


def replay(trace: list[TraceRequest], capacity: float, policy: str) -> HitRates:
    index = CapacityIndex(capacity, policy)
    hit_tokens = hit_blocks = total_blocks = total_tokens = 0
    for req in trace:
        ids = req.hash_ids
        matched = 0
        while matched < len(ids) and ids[matched] in index:
            matched += 1
        last_len = req.input_length - TRACE_BLOCK_TOKENS * (len(ids) - 1)
        hit_tokens += matched * TRACE_BLOCK_TOKENS - (
            TRACE_BLOCK_TOKENS - last_len if matched == len(ids) else 0
        )
        hit_blocks += matched
        total_blocks += len(ids)
        total_tokens += req.input_length
        for position, key in enumerate(ids):
            index.access_or_insert(key, position)
    return HitRates(hit_tokens / total_tokens, hit_blocks / total_blocks, index.evictions)


def cmd_replay(args: argparse.Namespace) -> None:
    capacities = [c.strip() for c in args.blocks.split(",")]
    policies = [p.strip() for p in args.policy.split(",")]
    for p in policies:
        if p not in POLICIES:
            raise SystemExit(f"--policy {p!r} is unknown; choose from {','.join(POLICIES)}")
    for c in capacities:
        if c != "inf" and not (c.isdigit() and int(c) > 0):
            raise SystemExit(f"--blocks {c!r} must be a positive integer or inf")
    trace = load_trace(args.trace)
    results: dict[str, dict[str, HitRates]] = {}
    t0 = time.perf_counter()
    for p in policies:
        results[p] = {c: replay(trace, math.inf if c == "inf" else int(c), p) for c in capacities}
    elapsed = time.perf_counter() - t0
    if args.json:
        print(
            json.dumps(
                {p: {c: round(r.tokens, 4) for c, r in rs.items()} for p, rs in results.items()}
            )
        )
        return
    n_blocks = sum(len(r.hash_ids) for r in trace)
    print(
        f"{args.trace}: {len(trace)} requests, {n_blocks} block accesses; "
        f"{len(policies) * len(capacities)} replays in {elapsed:.1f} s"
    )
    print(
        f"{'policy':8s} {'blocks':>8s} {'token hit':>10s} {'block hit':>10s} "
        f"{'evictions':>10s} {'README':>8s}"
    )
    for p, rs in results.items():
        for c, r in rs.items():
            ref = README_FIGURES.get(p, {}).get(c)
            ref_s = f"{ref:.1%}" if ref is not None else "-"
            print(f"{p:8s} {c:>8s} {r.tokens:10.1%} {r.blocks:10.1%} {r.evictions:10d} {ref_s:>8s}")
