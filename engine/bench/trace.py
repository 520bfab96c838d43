"""A Mooncake trace replayed on a real cluster, by placement policy (issue 10, item 4).

    .venv/bin/python profiling/bench_cluster.py --trace              # the defaults below
    .venv/bin/python profiling/bench_trace.py --window 6000 --sample 40 --replay-s 60 --reps 3

The conversation trace (data/traces/mooncake/conversation_trace.jsonl), sampled and
scaled to fit SmolLM2 on this CPU with its block sharing kept:

- sampled by conversation: of the first ``--window`` requests, those whose second hash id (the
  first block after the shared system prompt, which names the conversation: a later turn repeats
  the earlier turns' blocks) is a multiple of ``--sample``. Whole conversations are kept, so
  their turns find their earlier turns' prefixes, as in the full trace (a short contiguous
  stretch would not: a conversation's turns are minutes apart);
- every trace block id (a chained hash of a 512-token block) becomes ``--block-tokens``
  deterministic random tokens, so requests that share leading hash ids share a token prefix,
  and so the same KV blocks; ``input_length`` is scaled by the same factor (the last block
  partial) and capped at ``--max-prompt``; ``output_length`` by ``--out-scale``, capped at
  ``--max-out`` (greedy, EOS ignored);
- arrivals keep the trace's timestamps, compressed so the sample spans ``--replay-s`` seconds.

One cluster of 2 prefill + 1 decode worker processes (1 torch thread each) serves every run; a
run swaps in a fresh Conductor with the policy (``Router.set_placement``) and uses its own token
salt, so no run finds another's prefixes (their blocks only take cache room, as any unrelated
traffic would). Each repetition runs every policy, in an order rotated per repetition, so a
change of the machine's load over time does not favour one policy. Printed: per policy, the
median over the repetitions of each figure (TTFT p50/p90 over completed requests, time between
tokens p90 over all intervals, goodput = requests meeting both SLOs per second of trace time and
as a share of those sent, prompt-token prefix hit rate, rejections (429), failures).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import time
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from engine.sim.trace import DEFAULT_TRACE, TraceRequest, load_trace

# The body of profiling/bench_trace.py and of profiling/bench_cluster.py --trace (their usage is
# the docstring above, which --help prints).

POLICIES = ("random", "load", "cache_aware", "kvcentric")
TRACE_BLOCK = 512  # tokens per hash id in Mooncake's traces


class ScaledRequest(NamedTuple):
    arrival_s: float
    ids: list[int]
    max_tokens: int


def block_tokens_of(hash_id: int, n: int, salt: int) -> list[int]:
    """The ``n`` tokens that stand for trace block ``hash_id``: a function of (salt, id) only."""
    return np.random.default_rng([salt, hash_id]).integers(100, 40000, n).tolist()


def scale_trace(
    reqs: list[TraceRequest],
    block_tokens: int,
    max_prompt: int,
    out_scale: float,
    max_out: int,
    salt: int,
) -> list[ScaledRequest]:
    """Prompts built from the trace's hash ids (shared ids -> shared token prefixes)."""
    if block_tokens < 1 or max_prompt < 1 or max_out < 1 or not out_scale > 0:
        raise ValueError(
            f"block_tokens, max_prompt and max_out must be >= 1 and out_scale > 0, got "
            f"{block_tokens}, {max_prompt}, {max_out}, {out_scale}"
        )
    t0 = reqs[0].arrival_s if reqs else 0.0
    out = []
    cache: dict[int, list[int]] = {}
    for r in reqs:
        n = min(max_prompt, max(1, math.ceil(r.input_len * block_tokens / TRACE_BLOCK)))
        ids: list[int] = []
        for h in r.hash_ids:
            if len(ids) >= n:
                break
            if h not in cache:
                cache[h] = block_tokens_of(h, block_tokens, salt)
            ids += cache[h]
        if len(ids) < n:  # a trace whose hash ids do not cover its length: pad per request
            ids += block_tokens_of(-1 - r.index, n - len(ids), salt)
        out_len = min(max_out, max(1, round(r.output_len * out_scale)))
        out.append(ScaledRequest(r.arrival_s - t0, ids[:n], out_len))
    return out


class Result(NamedTuple):
    status: str  # ok | rejected | failed | timeout
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    gaps: list[float]  # time between tokens, one per token after the first


async def _one(router, r: ScaledRequest, rid: str, t_send: float) -> Result:
    from engine.core.scheduler import QueueFullError
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
    first, last, gaps, cached = None, None, [], 0
    try:
        async for out in router.generate(r.ids, params, request_id=rid):
            now = time.monotonic()
            k = len(out.outputs[0].new_token_ids)
            if k:
                if first is None:
                    first = now
                    k -= 1
                if k > 0 and last is not None:
                    gaps += [(now - last) / k] * k
                last = now
            if out.finished:
                cached = out.metrics.num_cached_tokens if out.metrics else 0
    except QueueFullError:  # the Conductor's 429 (RequestRejectedError) or the router's queue
        return Result("rejected", len(r.ids), 0, math.nan, [])
    except asyncio.CancelledError:
        return Result("timeout", len(r.ids), 0, math.nan, gaps)
    except Exception:
        return Result("failed", len(r.ids), 0, math.nan, gaps)
    if first is None:
        return Result("failed", len(r.ids), 0, math.nan, gaps)
    return Result("ok", len(r.ids), cached, first - t_send, gaps)


def start_at(offsets: list[float], send, after: list[int | None] | None = None) -> list:
    """Tasks that await ``send(i)`` for each request ``i`` at ``offsets[i]`` seconds from now,
    all free to run at once (no limit on how many are in flight); where ``after[i]`` names an
    earlier request, not before that one's task ended, however it ended. Each task's result is
    (the second after the start at which ``send`` was called, its result)."""
    start = time.monotonic()
    tasks: list[asyncio.Task] = []

    async def one(i: int, prev: asyncio.Task | None):
        delay = start + offsets[i] - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if prev is not None:
            await asyncio.wait([prev])
        return time.monotonic() - start, await send(i)

    after = after or [None] * len(offsets)
    for i, j in enumerate(after):
        if j is not None and not 0 <= j < i:
            raise ValueError(f"request {i} can only follow an earlier request, not {j}")
    for i, j in enumerate(after):
        tasks.append(asyncio.ensure_future(one(i, None if j is None else tasks[j])))
    return tasks


async def replay(router, reqs: list[ScaledRequest], tag: str, drain_s: float) -> list[Result]:
    """Send each request at its arrival time; whatever is not done ``drain_s`` after the last
    arrival is aborted (status timeout)."""
    start = time.monotonic()
    tasks = start_at(
        [r.arrival_s for r in reqs],
        lambda i: _one(router, reqs[i], f"{tag}-{i}", time.monotonic()),
    )
    end = start + (reqs[-1].arrival_s if reqs else 0.0) + drain_s
    done, pending = await asyncio.wait(tasks, timeout=max(0.0, end - time.monotonic()))
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    lost = Result("timeout", 0, 0, math.nan, [])
    return [lost if t.cancelled() else t.result()[1] for t in tasks]


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else math.nan


class Summary(NamedTuple):
    ttft_p50: float
    ttft_p90: float
    tbt_p90: float
    goodput_rps: float
    goodput_share: float
    hit_rate: float
    completed: int
    rejected: int
    failed: int


def summarize(results: list[Result], span_s: float, ttft_slo: float, tbt_slo: float) -> Summary:
    ok = [r for r in results if r.status == "ok"]
    ttfts = [r.ttft_s for r in ok]
    gaps = [g for r in ok for g in r.gaps]
    good = sum(
        1
        for r in ok
        if r.ttft_s <= ttft_slo and (not r.gaps or statistics.fmean(r.gaps) <= tbt_slo)
    )
    prompt = sum(r.prompt_tokens for r in ok)
    return Summary(
        _pct(ttfts, 50),
        _pct(ttfts, 90),
        _pct(gaps, 90),
        good / span_s if span_s > 0 else math.nan,
        good / len(results) if results else math.nan,
        sum(r.cached_tokens for r in ok) / prompt if prompt else math.nan,
        len(ok),
        sum(r.status == "rejected" for r in results),
        sum(r.status in ("failed", "timeout") for r in results),
    )


def median_summary(runs: list[Summary]) -> Summary:
    cols = list(zip(*runs))
    return Summary(*(statistics.median(c) for c in cols))


def print_table(rows: dict[str, Summary], reps: int, ttft_slo: float, tbt_slo: float) -> None:
    print(
        f"\n## Trace replay on 2 prefill + 1 decode (median of {reps}; SLOs TTFT {ttft_slo:g} s, "
        f"TBT {tbt_slo:g} s)"
    )
    print(
        "| policy | TTFT p50 (s) | TTFT p90 (s) | TBT p90 (s) | goodput (req/s) | goodput share "
        "| prefix hit rate | completed | rejected | failed |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for p, s in rows.items():
        print(
            f"| {p} | {s.ttft_p50:.2f} | {s.ttft_p90:.2f} | {s.tbt_p90:.3f} | "
            f"{s.goodput_rps:.3f} | {s.goodput_share:.2f} | {s.hit_rate:.2f} | "
            f"{s.completed:g} | {s.rejected:g} | {s.failed:g} |"
        )


def sample_conversations(reqs: list[TraceRequest], every: int) -> list[TraceRequest]:
    """The requests of every ``every``-th conversation (by the second hash id)."""
    if every < 1:
        raise ValueError(f"sample must be >= 1, got {every}")
    return [r for r in reqs if len(r.hash_ids) > 1 and r.hash_ids[1] % every == 0]


class Turn(NamedTuple):
    """A request of the conversation trace at its real scale (``real_scale_turns``)."""

    arrival_s: float  # trace seconds after the first chosen request
    conversation: int  # its conversation, numbered in the order of their first turns
    ids: list[int]  # the prompt's token ids


def real_scale_turns(conversations: int, salt: int, max_input: int) -> list[Turn]:
    """The conversation trace at its real scale: the first ``conversations`` whole conversations
    (named by their second hash id, as ``sample_conversations``) whose every turn has at most
    ``max_input`` tokens, each trace block ``TRACE_BLOCK`` tokens of its own (block ids kept, so a
    turn shares its earlier turns' prefix as in the trace), in the trace's order, with their
    arrivals (the trace's timestamps) and conversations.

    A conversation's turns are requests of their own in the trace, each a later timestamp (the
    user's next message, sent after the answer to the one before: the trace's gaps between turns
    are tens to hundreds of seconds), whose hash ids repeat the earlier turn's prompt blocks."""
    reqs = load_trace(DEFAULT_TRACE)
    convs: dict[int, list] = {}
    for r in reqs:
        convs.setdefault(r.hash_ids[1] if len(r.hash_ids) > 1 else -1 - r.index, []).append(r)
    chosen = [c for c in convs.values() if max(r.input_len for r in c) <= max_input]
    conversation_of = {r.index: k for k, c in enumerate(chosen[:conversations]) for r in c}
    turns: list[Turn] = []
    for r in reqs:
        if r.index in conversation_of:
            t0 = turns[0].arrival_s if turns else r.arrival_s
            ids = [t for h in r.hash_ids for t in block_tokens_of(h, TRACE_BLOCK, salt)]
            turns.append(Turn(r.arrival_s - t0, conversation_of[r.index], ids[: r.input_len]))
    return turns


def real_scale_conversations(conversations: int, salt: int, max_input: int) -> list[list[int]]:
    """The prompts of ``real_scale_turns``, in the trace's order."""
    return [t.ids for t in real_scale_turns(conversations, salt, max_input)]


def earlier_turns(turns: list[Turn]) -> list[int | None]:
    """For each turn, the index of the turn before it in its conversation (None for a first)."""
    last: dict[int, int] = {}
    out: list[int | None] = []
    for i, t in enumerate(turns):
        out.append(last.get(t.conversation))
        last[t.conversation] = i
    return out


async def send_turns(turns: list[Turn], speedup: float, send) -> list[tuple[float, object]]:
    """The trace at its own concurrency, ``speedup`` times faster: ``send(turn)`` (a coroutine)
    for each turn at its arrival divided by ``speedup`` seconds from now, whatever else is in
    flight then, except that a turn is not sent before the turn before it in its conversation
    has finished (it is then sent at once when that one ends). In the trace a turn is the
    user's answer to the one before; compressed in time (or on a server slower than the
    trace's), a turn's arrival can come before the answer it replies to has, and a client would
    not send it then. So at most one request per conversation is in flight, and a later turn
    finds its earlier turn's prompt in the server's prefix cache, as in the trace. Returns per
    turn (the second after the start at which it was sent, send's result), in the turns' order."""
    if not speedup > 0:
        raise ValueError(f"speedup must be > 0, got {speedup}")
    offsets = [t.arrival_s / speedup for t in turns]
    tasks = start_at(offsets, lambda i: send(turns[i]), earlier_turns(turns))
    return list(await asyncio.gather(*tasks))


def _record_decisions(placement) -> list:
    """Every Decision the placement makes (the Conductor's, for the verbose per-run line)."""
    decisions: list = []
    place = placement.place

    def recording(*args):
        out = place(*args)
        decisions.append(placement.last_decision)
        return out

    placement.place = recording
    return decisions


def _decision_counts(decisions: list) -> str:
    by: dict[str, int] = {}
    for d in decisions:
        key = d.prefill if d.accepted else f"rejected {d.reason}"
        by[key] = by.get(key, 0) + 1
    est = [d.est_ttft_s for d in decisions if d.accepted]
    mean = statistics.fmean(est) if est else math.nan
    return f"{dict(sorted(by.items()))}, estimated TTFT mean {mean:.2f} s"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace-file", default=str(DEFAULT_TRACE), help="Mooncake-format JSONL")
    p.add_argument("--window", type=int, default=6000, help="first N requests of the trace")
    p.add_argument("--sample", type=int, default=40, help="keep 1 conversation in this many")
    p.add_argument("--replay-s", type=float, default=60.0, help="seconds the sample spans")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per trace block")
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--out-scale", type=float, default=1 / 32)
    p.add_argument("--max-out", type=int, default=16)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rejection", default="predicted", help="none | early | predicted")
    p.add_argument("--ttft-slo", type=float, default=10.0)
    p.add_argument("--tbt-slo", type=float, default=0.5)
    p.add_argument("--drain", type=float, default=90.0, help="s after the last arrival")
    p.add_argument("--kv-gb", type=float, default=1.0, help="KV cache of each worker (GB)")
    p.add_argument(
        "--chunk", type=int, default=512, help="max batched tokens of a worker (prefill chunk)"
    )
    p.add_argument("--verbose", action="store_true", help="the Conductor's decisions per run")


def run(args: argparse.Namespace) -> dict[str, Summary]:
    from engine.cluster.conductor.adapter import make_placement
    from engine.cluster.launcher import Cluster
    from engine.cluster.router.router import RouterConfig

    policies = [p for p in args.policies.split(",") if p]
    cfg = RouterConfig(rejection=args.rejection, ttft_slo_s=args.ttft_slo, tbt_slo_s=args.tbt_slo)
    trace = sample_conversations(load_trace(args.trace_file, limit=args.window), args.sample)
    if len(trace) < 2:
        raise SystemExit("the sample holds fewer than 2 requests: widen --window or --sample")
    speed = (trace[-1].arrival_s - trace[0].arrival_s) / args.replay_s
    trace = [r._replace(arrival_s=r.arrival_s / speed) for r in trace]
    span = trace[-1].arrival_s - trace[0].arrival_s
    worker_args = [
        "--kv-cache-memory-gb", str(args.kv_gb), "--max-num-batched-tokens", str(args.chunk),
        "--kv-staging-mb", "256",
    ]  # fmt: skip
    runs: dict[str, list[Summary]] = {p: [] for p in policies}
    t_all = time.monotonic()
    with Cluster(2, 1, worker_args=worker_args, router_config=cfg, threads=1) as cluster:
        router = cluster.router
        warm = scale_trace(trace[:4], args.block_tokens, args.max_prompt, 1.0, 2, salt=999)
        asyncio.run(replay(router, [r._replace(arrival_s=0.0) for r in warm], "warm", 300))
        for rep in range(args.reps):
            order = policies[rep % len(policies) :] + policies[: rep % len(policies)]
            for policy in order:
                salt = 1000 * (rep + 1) + policies.index(policy)
                reqs = scale_trace(
                    trace, args.block_tokens, args.max_prompt, args.out_scale, args.max_out, salt
                )
                placement = make_placement(replace(cfg, policy=policy))
                decisions = _record_decisions(placement)
                router.set_placement(placement)
                t0 = time.monotonic()
                res = asyncio.run(replay(router, reqs, f"r{rep}{policy}", span + args.drain))
                s = summarize(res, span, args.ttft_slo, args.tbt_slo)
                runs[policy].append(s)
                print(
                    f"rep {rep} {policy:<12} {time.monotonic() - t0:6.1f} s  TTFT p50 "
                    f"{s.ttft_p50:.2f} p90 {s.ttft_p90:.2f}  goodput {s.goodput_share:.2f}  "
                    f"hit {s.hit_rate:.2f}  rejected {s.rejected}  failed {s.failed}  "
                    f"copies {placement.copies_done} ({placement.blocks_copied} blocks)  "
                    f"(load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
                if args.verbose:
                    print("   ", _decision_counts(decisions), flush=True)
    rows = {p: median_summary(runs[p]) for p in policies}
    prompts = scale_trace(trace, args.block_tokens, args.max_prompt, args.out_scale,
                          args.max_out, 0)  # fmt: skip
    print(
        f"\n{len(trace)} requests over {span:.1f} s of replay (trace time / {speed:.1f}); prompts "
        f"{statistics.mean(len(r.ids) for r in prompts):.0f} tokens on average, outputs "
        f"{statistics.mean(r.max_tokens for r in prompts):.1f}; whole run "
        f"{time.monotonic() - t_all:.0f} s; load average {os.getloadavg()[0]:.1f}"
    )
    print_table(rows, args.reps, args.ttft_slo, args.tbt_slo)
    print("\ncommand: " + " ".join([os.path.relpath(sys.argv[0]), *sys.argv[1:]]))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_args(p)
    run(p.parse_args(argv))
