"""Structured outputs: what a JSON-schema constraint costs a decode step, and what compiling costs.

    .venv/bin/python profiling/bench_structured.py                  # batch 16, 3 rounds
    .venv/bin/python profiling/bench_structured.py --batch 16 --rounds 5 --temperature 1
    .venv/bin/python profiling/bench_structured.py --serve        # (c) TTFT under schema churn

(a) Time per output token of a batch of ``--batch`` requests, each constrained by one of the
schemas below (in turn), against the same batch unconstrained. The constrained arm runs first in
each round and stops where each grammar ends; the unconstrained arm then runs the same prompts
with ``ignore_eos`` and each request's ``max_tokens`` set to the length its constrained twin
reached, so both arms run the same steps over the same batch sizes. Only decode steps count (the
steps after every request has its first token): per-token time is their wall time over the
tokens they produced. The arms alternate, round by round, so that a shared machine's drift hits
both alike; the ratio is given of the medians over rounds and as the median of each round's own
ratio (the steadier on a busy machine). The "sample" column is the engine's sampling
time per step (engine.step_times.sample): for the constrained arm it holds building the bitmask
and masking the logits.
(b) Compile time of each schema: cold (the compiler's first sight of it) and cached (a repeat),
in ms, on the compiler's pool (engine/structured/compiler.py: COMPILE_THREADS threads), and the
one-time cost of describing the tokenizer to xgrammar.
(c) With ``--serve``: ``engine serve`` in a subprocess; the TTFT of unconstrained streamed
completions sent at ``--probe-rate`` a second, quiet and then while another client sends a request
with a new JSON schema every 100 ms (``structured_outputs`` in the body, vLLM's extra field; each
schema differs, so each compiles; each generates ``--churn-tokens`` tokens). Those requests are
load as well as compiles, so two more phases send the same load without new compiles: the same
schema every 100 ms (compiled once, cached), and an unconstrained request every 100 ms. Reports
TTFT p50/p99 of each phase, the p99 ratios to quiet (the issue's target: schema churn <= 1.5x)
and to the same load unconstrained, and the second client's status codes.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import subprocess
import sys
import time

from engine.bench.json_schemas import SCHEMAS

TOPICS = ["a novel", "a city", "a planet", "a song", "a chemist", "a river", "a bridge", "a king"]


def prompts(tok, n: int) -> list[list[int]]:
    return [
        tok.encode(f"Reply with one JSON object only. Request {i}: describe {TOPICS[i % 8]}.")
        for i in range(n)
    ]


def run_batch(engine, prompts, params) -> tuple[float, int, int, float, list[int]]:
    """(decode wall s, decode tokens, decode steps, sampling s in them, output lengths)."""
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    started: set[str] = set()
    lengths: dict[str, int] = {}
    wall, tokens, steps, sample = 0.0, 0, 0, 0.0
    while engine.has_unfinished_requests():
        decoding = len(started) == len(rids)
        before = engine.step_times.sample
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        new = 0
        for o in outs:
            c = o.outputs[0]
            new += len(c.new_token_ids)
            if c.token_ids:
                started.add(o.request_id)
            if o.finished:
                lengths[o.request_id] = len(c.token_ids)
        if decoding and new:
            wall, tokens, steps = wall + dt, tokens + new, steps + 1
            sample += engine.step_times.sample - before
    return wall, tokens, steps, sample, [lengths[r] for r in rids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96, help="enough for every schema")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of both arms")
    ap.add_argument("--temperature", type=float, default=0.0, help="seeded when above 0")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--serve", action="store_true", help="(c) only: TTFT under schema churn")
    ap.add_argument("--seconds", type=float, default=20.0, help="(c): each phase's length")
    ap.add_argument("--probe-rate", type=float, default=4.0, help="(c): probes a second")
    ap.add_argument(
        "--churn-tokens",
        type=int,
        default=4,
        help="(c): max_tokens of the second client's requests (the probes take 4)",
    )
    args = ap.parse_args()
    if args.serve:
        serve_bench(args)
        return

    import torch

    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.core.llm_engine import LLMEngine
    from engine.cpu_isa import this_cpu
    from engine.sampling_params import SamplingParams
    from engine.structured.compiler import COMPILE_THREADS, GrammarCompiler
    from engine.structured.params import StructuredOutputs

    if args.threads:
        torch.set_num_threads(args.threads)
    print(this_cpu().describe(), flush=True)
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            device="cpu",
            cache=CacheConfig(num_blocks=1024, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_num_seqs=args.batch),
        )
    )
    tok, vocab = engine.tokenizer, engine.model_config.vocab_size
    print(f"model {args.model} {args.dtype}, torch threads {torch.get_num_threads()}")

    # (b) compile times, on a compiler of their own (the engine's stays cold for nothing).
    t0 = time.perf_counter()
    compiler = GrammarCompiler(tok, vocab)
    info_ms = (time.perf_counter() - t0) * 1e3
    print(
        f"\ncompiles: {COMPILE_THREADS} pool threads; tokenizer description {info_ms:.0f} ms once"
    )
    print("| schema | cold ms | cached ms |\n| --- | --- | --- |")
    for name, schema in SCHEMAS.items():
        so = StructuredOutputs(json=schema)
        t0 = time.perf_counter()
        compiler.compile(so)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiler.compile(so)
        cached = time.perf_counter() - t0
        print(f"| {name} | {cold * 1e3:.2f} | {cached * 1e3:.3f} |")
    compiler.close()

    # (a) time per output token, constrained against unconstrained.
    ps = prompts(tok, args.batch)
    schemas = list(SCHEMAS.values())
    seeded = args.temperature > 0

    def params(i: int, max_tokens: int, **kw) -> SamplingParams:
        seed = i if seeded else None
        return SamplingParams(temperature=args.temperature, seed=seed, max_tokens=max_tokens, **kw)

    constrained = [
        params(i, max_tokens=args.max_tokens, structured_outputs={"json": schemas[i % 4]})
        for i in range(args.batch)
    ]
    run_batch(engine, ps[:2], constrained[:2])  # warm-up: compiles, first steps
    arms: dict[str, list[tuple[float, int, int, float]]] = {"constrained": [], "unconstrained": []}
    for _ in range(args.rounds):
        wall, n, steps, sample, lengths = run_batch(engine, ps, constrained)
        arms["constrained"].append((wall, n, steps, sample))
        free = [params(i, max_tokens=lengths[i], ignore_eos=True) for i in range(args.batch)]
        wall, n, steps, sample, _ = run_batch(engine, ps, free)
        arms["unconstrained"].append((wall, n, steps, sample))
    finished_ok = sum(run_check(engine, ps, constrained))
    print(
        f"\n{args.batch} requests (the {len(SCHEMAS)} schemas in turn), "
        f"{'seeded temperature ' + str(args.temperature) if seeded else 'greedy'}, "
        f"{args.rounds} alternating rounds; decode steps only"
    )
    print("| arm | ms/token (median) | per round | decode steps | tokens | sample ms/step |")
    print("| --- | --- | --- | --- | --- | --- |")
    med = {}
    for arm, rows in arms.items():
        per_token = [1e3 * w / n for w, n, _, _ in rows]
        med[arm] = statistics.median(per_token)
        w, n, steps, sample = rows[-1]
        print(
            f"| {arm} | {med[arm]:.3f} | {' '.join(f'{x:.3f}' for x in per_token)} | {steps} "
            f"| {n} | {1e3 * sample / max(1, steps):.2f} |"
        )
    print(f"\nconstrained outputs that parse as JSON: {finished_ok}/{args.batch}")
    ratio = med["constrained"] / med["unconstrained"]
    pairs = [
        (c[0] / c[1]) / (u[0] / u[1])
        for c, u in zip(arms["constrained"], arms["unconstrained"], strict=True)
    ]
    print(f"per-round ratios: {' '.join(f'{r:.3f}' for r in pairs)}")
    print(
        f"time per output token, constrained / unconstrained: {ratio:.3f}x (medians), "
        f"{statistics.median(pairs):.3f}x (median of the rounds' ratios); target <= 1.10x"
    )
    engine.close()


async def probe(
    url: str, seconds: float, rate: float, churn: str, churn_tokens: int = 4
) -> tuple[list[float], dict]:
    """TTFTs of unconstrained streamed completions; with ``churn`` "new", a request with a new
    schema every 100 ms; "same": the same schema every 100 ms (the same load, compiled once);
    "plain": an unconstrained request every 100 ms (the same load, nothing to compile)."""
    import httpx

    ttfts: list[float] = []
    codes: collections.Counter = collections.Counter()
    body = {"model": "default", "prompt": "The capital of France is", "max_tokens": 4}

    async def one(client) -> None:
        t0 = time.perf_counter()
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    ttfts.append(time.perf_counter() - t0)
                    break

    async def constrained(client, i: int) -> None:
        field = f"field_{i if churn == 'new' else 0}"
        schema = {"type": "object", "properties": {field: {"type": "integer"}}}
        extra = {"structured_outputs": {"json": schema}} if churn != "plain" else {}
        r = await client.post("/v1/completions", json={**body, "max_tokens": churn_tokens, **extra})
        codes[r.status_code] += 1

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        tasks, end, i, next_probe = [], time.monotonic() + seconds, 0, 0.0
        while (now := time.monotonic()) < end:
            if now >= next_probe:
                tasks.append(asyncio.ensure_future(one(client)))
                next_probe = now + 1.0 / rate
            if churn:
                tasks.append(asyncio.ensure_future(constrained(client, i)))
                i += 1
            await asyncio.sleep(0.1 if churn else 1.0 / rate)
        await asyncio.gather(*tasks)
    return ttfts, dict(codes)


# (c)'s phases: a name, and what the second client sends every 100 ms (probe's ``churn``).
PHASES = (
    ("quiet", ""),
    ("schema churn", "new"),
    ("same schema", "same"),
    ("plain load", "plain"),
)


def serve_bench(args) -> None:
    import httpx

    from engine.ipc.ports import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "engine", "serve", "--model", args.model, "--dtype", args.dtype]
    cmd += ["--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"engine serve did not become healthy: {' '.join(cmd)}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        asyncio.run(probe(url, 2.0, args.probe_rate, ""))  # warm-up
        phases = {}
        for name, churn in PHASES:
            phases[name] = asyncio.run(
                probe(url, args.seconds, args.probe_rate, churn, args.churn_tokens)
            )
    finally:
        proc.terminate()
        proc.wait(30)
    print(
        f"\nunconstrained TTFT, {args.probe_rate:g} probes/s for {args.seconds:g} s a phase; "
        f"the second client's requests: max_tokens {args.churn_tokens}"
    )
    print("| phase | probes | TTFT p50 ms | TTFT p99 ms | churn status codes |")
    print("| --- | --- | --- | --- | --- |")
    p99 = {}
    for name, (ttfts, codes) in phases.items():
        xs = sorted(ttfts)
        p99[name] = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
        p50 = statistics.median(xs)
        print(f"| {name} | {len(xs)} | {1e3 * p50:.1f} | {1e3 * p99[name]:.1f} | {codes or '-'} |")
    for name in ("schema churn", "same schema", "plain load"):
        print(f"TTFT p99, {name} / quiet: {p99[name] / p99['quiet']:.2f}x")
    ratio = p99["schema churn"] / p99["plain load"]
    print(f"TTFT p99, schema churn / the same load unconstrained: {ratio:.2f}x")


def run_check(engine, prompts, params) -> list[bool]:
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o.outputs[0]
    out = []
    for r in rids:
        try:
            json.loads(final[r].text)
            out.append(final[r].finish_reason == "stop")
        except ValueError:
            out.append(False)
    return out


if __name__ == "__main__":
    main()
