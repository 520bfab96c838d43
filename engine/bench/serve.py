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
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np
from tqdm import tqdm

from engine.bench.datasets import BenchRequest, mooncake_requests, random_requests
from engine.cli.engine_options import add_engine_options, engine_argv, engine_config_from_args

# The body of profiling/bench_serve.py (its usage is the docstring above, which --help prints).

METRICS = ("ttft", "tpot", "itl", "e2el")
NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}
TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


@dataclass
class RequestResult:
    ok: bool = False
    input_len: int = 0
    output_len: int = 0
    start_s: float = 0.0  # since the benchmark began
    ttft: float = 0.0
    e2el: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


# -- backends -------------------------------------------------------------------------------------


class OpenAIBackend:
    name = "http"

    def __init__(self, base_url: str, model: str, ignore_eos: bool, temperature: float, n: int):
        limits = httpx.Limits(max_connections=max(n, 1), max_keepalive_connections=max(n, 1))
        self.client = httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits)
        self.model, self.ignore_eos, self.temperature = model, ignore_eos, temperature

    async def request(self, req: BenchRequest, res: RequestResult) -> None:
        body = {
            "model": self.model,
            "prompt": req.prompt,
            "max_tokens": req.output_len,
            "temperature": self.temperature,
            "ignore_eos": self.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0 = time.perf_counter()
        last = t0
        async with self.client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return
                if chunk.get("usage"):
                    res.output_len = chunk["usage"]["completion_tokens"]
                if chunk["choices"]:
                    now = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
        res.e2el = time.perf_counter() - t0
        res.ok = True

    async def prefix_counters(self) -> tuple[float, float]:
        text = (await self.client.get("/metrics")).text
        values = {}
        for line in text.splitlines():
            for key in ("engine:prefix_cache_queries_total", "engine:prefix_cache_hits_total"):
                if line.startswith(key + "{"):
                    values[key] = values.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return (
            values.get("engine:prefix_cache_queries_total", 0.0),
            values.get("engine:prefix_cache_hits_total", 0.0),
        )

    async def close(self) -> None:
        await self.client.aclose()


class EmbeddedBackend:
    name = "embedded"

    def __init__(self, llm, ignore_eos: bool, temperature: float):
        self.llm, self.ignore_eos, self.temperature = llm, ignore_eos, temperature

    async def request(self, req: BenchRequest, res: RequestResult) -> None:
        from engine.sampling_params import SamplingParams

        params = SamplingParams(
            max_tokens=req.output_len, temperature=self.temperature, ignore_eos=self.ignore_eos
        )
        t0 = time.perf_counter()
        last = t0
        out = None
        async for out in self.llm.generate(req.prompt, params):
            if out.outputs[0].new_token_ids:
                now = time.perf_counter()
                if res.ttft == 0.0:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                last = now
        res.e2el = time.perf_counter() - t0
        res.output_len = len(out.outputs[0].token_ids) if out else 0
        res.ok = True

    async def prefix_counters(self) -> tuple[float, float]:
        m = self.llm.metrics()
        return float(m.prefix_queries), float(m.prefix_hits)

    async def close(self) -> None:
        pass


# -- running a workload ---------------------------------------------------------------------------


def arrival_delays(args, requests: list[BenchRequest]) -> list[float]:
    """Seconds after the start at which each request is sent."""
    if args.dataset_name == "mooncake" and args.request_rate is None:
        t0 = requests[0].arrival_s or 0.0
        return [((r.arrival_s or 0.0) - t0) * args.mooncake_time_scale for r in requests]
    rate = args.request_rate if args.request_rate is not None else float("inf")
    if rate == float("inf"):
        return [0.0] * len(requests)
    rng = np.random.default_rng(args.seed)
    theta = 1.0 / (rate * args.burstiness)  # gamma with mean 1/rate; burstiness 1 = Poisson
    gaps = rng.gamma(shape=args.burstiness, scale=theta, size=len(requests))
    return list(np.cumsum(gaps) - gaps[0])


async def run_workload(backend, requests, delays, concurrency, show_progress) -> dict:
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    results = [RequestResult(input_len=len(r.prompt)) for r in requests]
    bar = tqdm(total=len(requests), disable=not show_progress, desc=backend.name, unit="req")
    q0, h0 = await backend.prefix_counters()
    start = time.perf_counter()

    async def one(i: int) -> None:
        wait = start + delays[i] - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        if sem is not None:
            await sem.acquire()
        try:
            results[i].start_s = time.perf_counter() - start
            await backend.request(requests[i], results[i])
        except Exception as exc:  # counted as a failed request, reported below
            results[i].error = f"{type(exc).__name__}: {exc}"
        finally:
            if sem is not None:
                sem.release()
            bar.update(1)

    await asyncio.gather(*(one(i) for i in range(len(requests))))
    duration = time.perf_counter() - start
    bar.close()
    q1, h1 = await backend.prefix_counters()
    return {
        "duration": duration,
        "results": results,
        "prefix_cache_hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
    }


def summarize(backend: str, run: dict, args) -> dict:
    results: list[RequestResult] = run["results"]
    ok = [r for r in results if r.ok]
    duration = run["duration"]
    per = {
        "ttft": [r.ttft * 1000 for r in ok],
        "tpot": [(r.e2el - r.ttft) * 1000 / (r.output_len - 1) for r in ok if r.output_len > 1],
        "itl": [x * 1000 for r in ok for x in r.itl],
        "e2el": [r.e2el * 1000 for r in ok],
    }
    slo = dict(args.goodput or {})
    good = 0
    for r in ok:
        tpot = (r.e2el - r.ttft) * 1000 / (r.output_len - 1) if r.output_len > 1 else 0.0
        values = {"ttft": r.ttft * 1000, "tpot": tpot, "e2el": r.e2el * 1000}
        good += all(values[k] <= v for k, v in slo.items())
    total_in = sum(r.input_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    out = {
        "backend": backend,
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if slo else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate,
        "prefix_cache_hit_rate": run["prefix_cache_hit_rate"],
        "goodput_slo_ms": slo or None,
    }
    for m in METRICS:
        xs = np.array(per[m]) if per[m] else np.array([np.nan])
        out[f"mean_{m}_ms"] = float(np.mean(xs))
        out[f"median_{m}_ms"] = float(np.median(xs))
        out[f"std_{m}_ms"] = float(np.std(xs))
        for p in args.metric_percentiles:
            out[f"p{p:g}_{m}_ms"] = float(np.percentile(xs, p))
    out["errors"] = [r.error for r in results if not r.ok][:20]
    out["requests"] = [
        {k: v for k, v in asdict(r).items() if k != "itl"} for r in results
    ]  # per-request figures, for plots
    return out


def print_result(s: dict, args) -> None:
    w = 50
    print("{s:{c}^{n}}".format(s=f" Serving Benchmark Result ({s['backend']}) ", n=w, c="="))
    rows = [
        ("Successful requests:", s["completed"]),
        ("Failed requests:", s["failed"]),
        ("Maximum request concurrency:", s["max_concurrency"]),
        ("Benchmark duration (s):", f"{s['duration']:.2f}"),
        ("Total input tokens:", s["total_input_tokens"]),
        ("Total generated tokens:", s["total_output_tokens"]),
        ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
    ]
    if s["request_goodput"] is not None:
        rows.append(("Request goodput (req/s):", f"{s['request_goodput']:.2f}"))
    rows += [
        ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}"),
        ("Prefix cache hit rate:", f"{s['prefix_cache_hit_rate']:.1%}"),
    ]
    for k, v in rows:
        print(f"{k:<40}{v!s:<10}")
    for m in METRICS:
        print("{s:{c}^{n}}".format(s=TITLES[m], n=w, c="-"))
        print(f"{'Mean ' + NAMES[m] + ' (ms):':<40}{s[f'mean_{m}_ms']:<10.2f}")
        print(f"{'Median (P50) ' + NAMES[m] + ' (ms):':<40}{s[f'median_{m}_ms']:<10.2f}")
        for p in (p for p in args.metric_percentiles if p != 50):
            print(f"{f'P{p:g} ' + NAMES[m] + ' (ms):':<40}{s[f'p{p:g}_{m}_ms']:<10.2f}")
    for e in s["errors"][:5]:
        print("error:", e)
    print("=" * w)


def plot(summaries: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    rounds = len({s.get("round", 0) for s in summaries})
    for s in summaries:
        label = s["backend"] + (f" (round {s['round']})" if rounds > 1 else "")
        reqs = [r for r in s["requests"] if r["ok"]]
        t = [r["start_s"] + r["e2el"] for r in reqs]  # completion time
        start = [r["start_s"] for r in reqs]
        axes[0].scatter(start, [r["ttft"] * 1000 for r in reqs], s=8, label=label)
        tpot = [
            (r["e2el"] - r["ttft"]) * 1000 / (r["output_len"] - 1) if r["output_len"] > 1 else 0
            for r in reqs
        ]
        axes[1].scatter(start, tpot, s=8, label=label)
        order = np.argsort(t)
        done = np.arange(1, len(t) + 1)
        axes[2].plot(np.array(t)[order], done, label=label)
    axes[0].set_ylabel("TTFT (ms)")
    axes[1].set_ylabel("TPOT (ms)")
    axes[2].set_ylabel("requests completed")
    axes[2].set_xlabel("seconds since the benchmark started (TTFT/TPOT by request start)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Latency over time")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
