"""Online serving benchmark in the shape of ``vllm bench serve``: TTFT, TPOT, ITL and e2e latency
(mean, median, p90, p99), request and token throughput, goodput under SLOs.

    # against a running server (engine serve --model default)
    .venv/bin/python profiling/bench_serve.py --base-url http://127.0.0.1:8000 \\
        --num-prompts 64 --max-concurrency 16 --random-input-len 200 --random-output-len 64

    # HTTP vs the embedded AsyncLLM at the same concurrency, one command: starts the server
    # with the same engine arguments, benchmarks it, stops it, runs the same workload in-process
    .venv/bin/python profiling/bench_serve.py --launch-server --compare-embedded \\
        --num-prompts 64 --max-concurrency 16 --random-input-len 200 --random-output-len 64

    # a Mooncake trace, lengths scaled to 1/32 (16-token blocks), arrivals replayed 4x slower
    .venv/bin/python profiling/bench_serve.py --launch-server --dataset-name mooncake \\
        --dataset-path data/traces/mooncake/conversation_trace.jsonl \\
        --mooncake-scale 0.03125 --mooncake-time-scale 4 --num-prompts 100

Backends: ``openai`` streams /v1/completions (prompts sent as token ids, so input lengths are
exact); ``embedded`` drives ``AsyncLLM.generate`` in this process. Definitions as vLLM's: TTFT to
the first streamed token, ITL between streamed chunks, TPOT = (e2e - TTFT) / (output - 1),
goodput = requests/s meeting every --goodput SLO. Re-running against the same server hits its
prefix cache; the prefix-cache hit rate of each run is printed, vary --seed to avoid it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np

from engine.bench.arrivals import arrival_delays, run_workload
from engine.bench.backends import EmbeddedBackend, OpenAIBackend
from engine.bench.datasets import BenchRequest, mooncake_requests, random_requests
from engine.bench.summary import plot, print_result, summarize
from engine.cli.engine_options import add_engine_options, engine_argv, engine_config_from_args

# The body of profiling/bench_serve.py (its usage is the docstring above, which --help prints):
# the targets (a server or the engine in this process) and the command line. The clients are in
# engine/bench/backends.py, the arrivals in arrivals.py, the figures in summary.py.


# -- the server, the engine, the workload --------------------------------------------------------


def launch_server(args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "engine", "serve", *engine_argv(args), "--port", str(port)]
    cmd += ["--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the server did not become healthy in 300 s")


def load_tokenizer(model: str):
    from engine.model.gguf_loader import load_gguf_checkpoint
    from engine.model.hf_loader import load_hf_checkpoint
    from engine.model.loader import resolve_model_path

    path = resolve_model_path(model)
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")):
        path = os.path.join(path, next(f for f in sorted(os.listdir(path)) if f.endswith(".gguf")))
    return (
        load_hf_checkpoint(path) if os.path.isdir(path) else load_gguf_checkpoint(path)
    ).tokenizer


def build_requests(args, tokenizer, max_model_len: int | None) -> list[BenchRequest]:
    n = args.num_prompts + args.warmup
    if args.dataset_name == "random":
        reqs = random_requests(
            tokenizer,
            n,
            args.random_input_len,
            args.random_output_len,
            args.random_prefix_len,
            args.random_range_ratio,
            args.seed,
            max_model_len,
        )
    else:
        if not args.dataset_path:
            raise SystemExit("--dataset-name mooncake needs --dataset-path (a trace .jsonl)")
        reqs = mooncake_requests(
            tokenizer, args.dataset_path, n, args.mooncake_scale, args.seed, max_model_len
        )
    return reqs


async def bench(backend, args, requests: list[BenchRequest]) -> dict:
    warm, measured = requests[: args.warmup], requests[args.warmup :]
    if warm:  # first calls pay one-off costs (allocator, kernels): keep them out of the figures
        await run_workload(backend, warm, [0.0] * len(warm), args.max_concurrency, False)
    delays = arrival_delays(args, measured)
    run = await run_workload(backend, measured, delays, args.max_concurrency, not args.disable_tqdm)
    await backend.close()
    return summarize(backend.name, run, args)


class HTTPTarget:
    """A server to benchmark: the one at --base-url, or one started with --launch-server."""

    def __init__(self, args) -> None:
        self.args, self.proc, self.base_url = args, None, args.base_url
        self.tokenizer = load_tokenizer(args.model)

    def __enter__(self) -> HTTPTarget:
        if self.args.launch_server:
            self.proc, self.base_url = launch_server(self.args)
            print(f"launched engine serve at {self.base_url}", file=sys.stderr)
        self.card = httpx.get(self.base_url + "/v1/models", timeout=30).json()["data"][0]
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=120)

    def run(self, args) -> dict:
        requests = build_requests(args, self.tokenizer, self.card.get("max_model_len"))
        backend = OpenAIBackend(
            self.base_url,
            self.card["id"],
            args.ignore_eos,
            args.temperature,
            args.max_concurrency or 1024,
        )
        return asyncio.run(bench(backend, args, requests))


class EmbeddedTarget:
    """The same engine in this process, driven through AsyncLLM."""

    def __init__(self, args) -> None:
        self.args = args

    def __enter__(self) -> EmbeddedTarget:
        from engine.async_llm import AsyncLLM

        config = engine_config_from_args(self.args).with_overrides(show_progress=False)
        self.llm = AsyncLLM(config=config)
        return self

    def __exit__(self, *exc) -> None:
        self.llm.close()

    def run(self, args) -> dict:
        requests = build_requests(args, self.llm.tokenizer, self.llm.max_model_len)
        backend = EmbeddedBackend(self.llm, args.ignore_eos, args.temperature)
        return asyncio.run(bench(backend, args, requests))


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    out = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not value:
            raise SystemExit(f"--goodput takes ttft:MS tpot:MS e2el:MS, got {item!r}")
        out[key] = float(value)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", choices=["openai", "embedded"], default="openai")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--launch-server", action="store_true", help="start engine serve for the run")
    p.add_argument("--compare-embedded", action="store_true", help="also run embedded; ratio")
    p.add_argument("--dataset-name", choices=["random", "mooncake"], default="random")
    p.add_argument("--dataset-path", default=None, help="the mooncake trace (.jsonl)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-prefix-len", type=int, default=0)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--mooncake-scale", type=float, default=1 / 32, help="length scale")
    p.add_argument(
        "--mooncake-time-scale", type=float, default=1.0, help="multiply the trace's gaps"
    )
    p.add_argument("--request-rate", type=float, default=None, help="req/s (default inf)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--goodput", nargs="+", default=None, help="SLOs: ttft:MS tpot:MS e2el:MS")
    p.add_argument("--metric-percentiles", default="50,90,99")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--rounds", type=int, default=1, help="alternate the targets this often")
    p.add_argument("--warmup", type=int, default=2, help="requests before the measured ones")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", default=None, help="write the results as JSON here")
    p.add_argument("--plot", default=None, help="write a PNG of latency over time here")
    p.add_argument("--disable-tqdm", action="store_true")
    add_engine_options(p)  # for --launch-server and the embedded backend: the same engine
    args = p.parse_args(argv)
    args.goodput = parse_goodput(args.goodput)
    args.metric_percentiles = [float(x) for x in args.metric_percentiles.split(",")]
    random.seed(args.seed)

    targets = []
    if args.backend == "openai":
        targets.append(HTTPTarget(args))
    if args.backend == "embedded" or args.compare_embedded:
        targets.append(EmbeddedTarget(args))
    summaries, ratios = [], []
    with contextlib.ExitStack() as stack:
        for t in targets:
            stack.enter_context(t)
        # Rounds alternate the targets, each round on fresh prompts (seed + round) so that no
        # run hits a prefix cache warmed by another: on a shared machine, load that comes and
        # goes then hits both sides alike.
        for r in range(args.rounds):
            round_args = argparse.Namespace(**{**vars(args), "seed": args.seed + r})
            row = []
            for t in targets:
                row.append(t.run(round_args) | {"round": r})
                print_result(row[-1], args)
            summaries += row
            if len(row) == 2:
                ratios.append(row[0]["output_throughput"] / row[1]["output_throughput"])
                print(f"round {r}: HTTP / embedded output throughput {ratios[-1]:.1%}")
    result = {"args": dict(vars(args)), "runs": summaries}
    if ratios:
        result["http_over_embedded_output_throughput"] = ratios
        result["http_over_embedded_median"] = float(np.median(ratios))
        print(
            f"HTTP / embedded output throughput: median {np.median(ratios):.1%} over "
            f"{len(ratios)} round(s) {[f'{x:.1%}' for x in ratios]} (target >= 90%)"
        )
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2, default=str)
    if args.plot:
        plot(summaries, args.plot)
    return 0
