"""The priority benchmark (profiling/bench_priority.py): a chat load of more concurrent requests
than the engine serves at once, a share of them high-priority, against ``engine serve
--scheduling-policy fcfs`` and then ``priority`` (the same engine options, the same requests): the
time to first token of each class under each policy, and the high-priority TTFT p90 under
priority over the same under fcfs.

Both servers are up for the whole run; each round sends new requests to one and then the same
to the other (the order alternating). The load is a closed loop: ``overload x --max-num-seqs``
clients, each sending its next request when its last one ended, so the engine always has as many
requests waiting as running. Requests stream ``/v1/chat/completions`` (``ignore_eos``, greedy)
with output lengths spread around ``--max-tokens`` (``--output-spread``), as a chat's replies
are, so that sequence slots free up one by one rather than in waves (with equal lengths every
request that waits, of either class, waits for the whole wave before it). Every
``1 / high_share``-th request is a high-priority one. Under priority they carry ``priority`` 0
(high) or 1 (low); under fcfs no priority (the server would refuse one), so they are served in
arrival order. The first ``clients`` requests of a run, sent together at its start, are not
counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from dataclasses import dataclass

import httpx
import numpy as np

from engine.bench.serve import launch_server
from engine.bench.workload import WORDS
from engine.cli.engine_options import add_engine_options

HIGH, LOW = 0, 1  # the priority values sent under --scheduling-policy priority (lower first)
POLICIES = ("fcfs", "priority")


@dataclass
class ChatRequest:
    messages: list[dict]
    high: bool
    max_tokens: int


@dataclass
class Sample:
    high: bool
    ttft: float = 0.0
    e2el: float = 0.0
    output_tokens: int = 0
    error: str = ""


def chat_requests(
    num: int, words: int, high_share: float, seed: int, max_tokens: int = 32, spread: float = 0.0
) -> list[ChatRequest]:
    """``num`` user messages of ``words`` random words, each asking for a number of tokens
    uniform in ``max_tokens x [1 - spread, 1 + spread]``; every ``round(1 / high_share)``-th one
    (from the first) is high-priority, so the high ones are spread through the load."""
    if not 0 < high_share <= 1:
        raise ValueError(f"high_share must be in (0, 1], got {high_share}")
    if not 0 <= spread < 1:
        raise ValueError(f"spread must be in [0, 1), got {spread}")
    every = max(1, round(1 / high_share))
    lo, hi = max(1, round(max_tokens * (1 - spread))), round(max_tokens * (1 + spread))
    rng = random.Random(seed)
    out = []
    for i in range(num):
        text = f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(words))
        out.append(
            ChatRequest([{"role": "user", "content": text}], i % every == 0, rng.randint(lo, hi))
        )
    return out


def body(req: ChatRequest, model: str, policy: str) -> dict:
    out = {
        "model": model,
        "messages": req.messages,
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if policy == "priority":
        out["priority"] = HIGH if req.high else LOW
    return out


async def one(client: httpx.AsyncClient, payload: dict, sample: Sample) -> None:
    """Stream one chat completion; its TTFT (to the first chunk with a choice) and e2e."""
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=payload) as r:
        if r.status_code != 200:
            sample.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                sample.error = chunk["error"]["message"]
                return
            if chunk.get("usage"):
                sample.output_tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and sample.ttft == 0.0:
                sample.ttft = time.perf_counter() - t0
    sample.e2el = time.perf_counter() - t0


async def closed_loop(
    base_url: str, model: str, requests: list[ChatRequest], clients: int, policy: str
) -> tuple[list[Sample], float]:
    """Every request, ``clients`` at a time (each client sends its next when one ends): the
    samples in request order and the seconds the whole load took."""
    samples = [Sample(r.high) for r in requests]
    pending = list(range(len(requests)))
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base_url, timeout=3600, limits=limits) as client:

        async def worker() -> None:
            while pending:
                i = pending.pop(0)
                await one(client, body(requests[i], model, policy), samples[i])

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
    return samples, time.perf_counter() - t0


def summarize(samples: list[Sample], seconds: float, skip: int = 0) -> dict:
    """TTFT p50/p90 and e2e p50 (ms) of each class, the first ``skip`` samples left out, and
    the output tokens per second of them all."""
    errors = [s.error for s in samples if s.error]
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed, the first: {errors[0]}")
    out: dict = {"output_tok_s": sum(s.output_tokens for s in samples) / seconds}
    samples = samples[skip:]
    for name, high in (("high", True), ("low", False)):
        group = [s for s in samples if s.high == high]
        ttft = np.array([s.ttft for s in group]) * 1e3
        out[name] = {
            "requests": len(group),
            "ttft_p50_ms": float(np.percentile(ttft, 50)),
            "ttft_p90_ms": float(np.percentile(ttft, 90)),
            "e2el_p50_ms": float(np.percentile([s.e2el * 1e3 for s in group], 50)),
        }
    return out


class Server:
    """``engine serve --scheduling-policy POLICY`` with the other engine options given, up for
    the whole benchmark (an idle one costs the other nothing), warmed up before the first run."""

    def __init__(self, args, policy: str) -> None:
        self.policy = policy
        self.proc, self.url = launch_server(
            argparse.Namespace(**{**vars(args), "scheduling_policy": policy})
        )
        self.model = httpx.get(self.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        warm = chat_requests(args.max_num_seqs, args.prompt_words, 1.0, args.seed + 1000, 4)
        asyncio.run(closed_loop(self.url, self.model, warm, args.max_num_seqs, policy))

    def run(self, args, requests: list[ChatRequest]) -> dict:
        """The load, ``overload x --max-num-seqs`` clients at a time, summarized."""
        clients = max(1, round(args.overload * args.max_num_seqs))
        samples, seconds = asyncio.run(
            closed_loop(self.url, self.model, requests, clients, self.policy)
        )
        summary = summarize(samples, seconds, skip=clients)  # not the burst at the start
        return {"policy": self.policy, "clients": clients, "seconds": seconds} | summary

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)


def print_table(runs: list[dict]) -> None:
    print("| policy | class | requests | TTFT p50 | TTFT p90 | e2e p50 | output tok/s |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in runs:
        for name in ("high", "low"):
            c = r[name]
            print(
                f"| {r['policy']} | {name} | {c['requests']} | {c['ttft_p50_ms']:.0f} ms | "
                f"{c['ttft_p90_ms']:.0f} ms | {c['e2el_p50_ms']:.0f} ms | "
                f"{r['output_tok_s']:.1f} |"
            )


def ratios(runs: list[dict]) -> dict:
    """High- and low-priority TTFT p90 under priority over fcfs: each round's (both policies ran
    its requests, one after the other) and their median, which a machine whose speed drifts
    between rounds disturbs less than a ratio of the pooled runs would be."""
    out: dict = {}
    for name in ("high", "low"):
        per_round = []
        for r in sorted({run["round"] for run in runs}):
            p90 = {run["policy"]: run[name]["ttft_p90_ms"] for run in runs if run["round"] == r}
            per_round.append(p90["priority"] / p90["fcfs"])
        out[name] = float(np.median(per_round))
        out[f"{name}_rounds"] = per_round
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=sys.modules[__name__].__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--num-requests", type=int, default=80, help="per policy and round")
    p.add_argument("--high-share", type=float, default=0.2, help="of the requests, high-priority")
    p.add_argument("--overload", type=float, default=2.0, help="clients per --max-num-seqs")
    p.add_argument("--prompt-words", type=int, default=60, help="random words per message")
    p.add_argument("--max-tokens", type=int, default=32, help="mean output tokens (ignore_eos)")
    p.add_argument(
        "--output-spread", type=float, default=0.75, help="output lengths: mean x [1 -+ this]"
    )
    p.add_argument("--rounds", type=int, default=1, help="both policies, in turn, this often")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", default=None, help="write the runs as JSON here")
    add_engine_options(p)  # engine serve's, but --scheduling-policy, which the runs set
    p.set_defaults(max_num_seqs=8)
    args = p.parse_args(argv)
    from engine.cpu_isa import this_cpu

    servers: dict[str, Server] = {}
    runs = []
    try:
        for policy in POLICIES:
            servers[policy] = Server(args, policy)
        # Each round's requests are new (seed + round: no prefix-cache hits from a round before),
        # the same for both policies; the order alternates, so drift hits both alike.
        for r in range(args.rounds):
            requests = chat_requests(
                args.num_requests, args.prompt_words, args.high_share, args.seed + r,
                args.max_tokens, args.output_spread,
            )  # fmt: skip
            for policy in POLICIES if r % 2 == 0 else POLICIES[::-1]:
                runs.append(servers[policy].run(args, requests) | {"round": r})
                print(f"round {r}, {policy}: {runs[-1]['seconds']:.1f} s", file=sys.stderr)
    finally:
        for server in servers.values():
            server.stop()
    print_table(runs)
    rel = ratios(runs)
    print(
        f"\nhigh-priority TTFT p90, priority / fcfs: {rel['high']:.2f}x, median of the rounds' "
        f"{[round(x, 2) for x in rel['high_rounds']]} (low-priority: {rel['low']:.2f}x); "
        f"{args.max_num_seqs} sequences served at once, "
        f"{round(args.overload * args.max_num_seqs)} clients, {args.high_share:.0%} high"
    )
    print(f"CPU: {this_cpu().model}")
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "ratios": rel}, f, indent=2, default=str)
    return 0
