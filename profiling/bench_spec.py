"""Speculative decoding: `engine serve` with and without draftless speculation against llama.cpp's
`llama-server` with and without its n-gram speculation, on the same prompts, in one run.

    .venv/bin/python profiling/bench_spec.py --llama-server /path/to/llama-server
    .venv/bin/python profiling/bench_spec.py --workloads repetitive --batches 1

Workloads (streamed /v1/completions, chat-formatted prompts sent as token ids, greedy):

- ``repetitive``: 24 requests that copy most of what they were given, what agents and coding
  tools send: edit a given function (rename one name, change one constant), answer by quoting a
  given passage, repeat a tool call's JSON with one field changed. Each ends where the model
  ends it (EOS), at most 256 tokens.
- ``chat``: 24 prompts of 60-400 random words, 96 output tokens each with ignore_eos (as
  bench_peer.py's chat workload): text that does not repeat, where speculation must cost almost
  nothing.

Each runs at batch 1 (one request at a time) and at batch 16 (16 at a time). Figures: decode
tok/s (output tokens after the first over the time after the first, summed over requests: at
batch 1 the per-request decode speed) and output tok/s (all output over the wall time). Every
system is up for the whole run (the same thread count each; an idle server takes no CPU) and
each load runs on one system at a time, every system in turn, ``--rounds`` times (the order
reversed every other round); the tables give the medians. llama-server runs with 16 slots
(``-np``) and continuous batching, without speculation and with each ``--llama-spec`` setting;
the table marks its best. Ratios are against our engine without speculation and against
llama-server's best.
Building llama-server: docs/cpu.md ("Comparing with llama.cpp").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time

import httpx

from engine.bench.serve import load_tokenizer
from engine.bench.servers import Server, chat_ids, gguf_file, stream_completion, thread_env
from engine.bench.summary import median_over_rounds, round_order
from engine.bench.workload import WORDS
from engine.ipc.ports import free_port

MAX_TOKENS = 256
SLOTS = 16

FUNCTIONS = [
    '''def moving_average(values, window):
    """Return the moving averages of values over a window."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out''',
    '''def parse_config(path):
    """Read a key=value file into a dict, skipping comments."""
    config = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, _, value = line.partition("=")
            config[key.strip()] = value.strip()
    return config''',
    """class RateLimiter:
    def __init__(self, rate, burst):
        self.rate = rate
        self.burst = burst
        self.tokens = burst
        self.last = 0.0

    def allow(self, now):
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False""",
    '''def merge_sorted(a, b):
    """Merge two sorted lists into one sorted list."""
    i = j = 0
    out = []
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out''',
]
EDITS = [
    ("Rename the variable total to running_sum", "Change the error message to say 'bad window'"),
    ("Rename the function to load_config", "Make it skip lines that start with ';' too"),
    ("Rename the class to TokenBucket", "Rename the method allow to try_acquire"),
    ("Rename the function to merge_two", "Rename the variable out to merged"),
]
PASSAGES = [
    "Mooncake is the serving platform for Kimi, a chatbot service. It features a "
    "KVCache-centric disaggregated architecture that separates the prefill and decoding "
    "clusters. It also uses the underutilized CPU, DRAM, and SSD resources of the GPU cluster "
    "to implement a disaggregated cache of KVCache. The core of Mooncake is its KVCache-centric "
    "scheduler, which balances maximizing overall effective throughput while meeting "
    "latency-related Service Level Objectives.",
    "The prefill stage processes all input tokens in parallel and produces the first output "
    "token, while the decoding stage generates one token at a time. Because the prefill stage "
    "is compute bound and the decoding stage is memory bound, running them on the same machine "
    "makes each wait for the other. Separating them lets each use its own batch size and its "
    "own parallelism.",
    "A prefix cache keeps the key and value tensors of tokens that earlier requests computed, "
    "so that a new request whose prompt starts with the same tokens can load them instead of "
    "computing them again. The blocks are named by a hash of their tokens and of every token "
    "before them, so two prompts share a block only when they share everything up to its end.",
    "Speculative decoding guesses several tokens ahead and asks the model to check all of the "
    "guesses in a single forward pass. Every guess the model agrees with is kept, and the first "
    "one it disagrees with is replaced by its own choice. When the guesses are good the model "
    "produces several tokens for the price of one step.",
]
QUESTIONS = [
    "Quote the passage word for word, then say in one sentence what it is about.",
    "Repeat the passage exactly as it is written.",
]
TOOL_CALLS = [
    {
        "name": "create_ticket",
        "arguments": {
            "title": "Login page times out",
            "priority": "high",
            "assignee": "dana",
            "labels": ["auth", "frontend", "regression"],
            "status": "open",
        },
    },
    {
        "name": "search_flights",
        "arguments": {
            "from": "SFO",
            "to": "NRT",
            "date": "2026-03-14",
            "passengers": 2,
            "cabin": "economy",
            "max_stops": 1,
        },
    },
    {
        "name": "update_record",
        "arguments": {
            "table": "customers",
            "id": 48213,
            "fields": {"email": "ada@example.com", "city": "London", "plan": "pro"},
            "status": "pending",
        },
    },
    {
        "name": "send_email",
        "arguments": {
            "to": ["ops@example.com", "lead@example.com"],
            "subject": "Nightly build failed",
            "body": "The nightly build failed at the test stage.",
            "status": "draft",
        },
    },
]
JSON_ASKS = [
    'Call the same tool again with exactly the same arguments, but with "status" set to '
    '"done". Answer with the JSON only.',
    "Repeat this tool call's JSON exactly, with one more label or field of your choice. "
    "Answer with the JSON only.",
]


def repetitive(tok) -> list[list[int]]:
    prompts = []
    for code, edits in zip(FUNCTIONS, EDITS, strict=True):
        for edit in edits:
            ask = f"{edit} in the code below and change nothing else. Answer with the whole code."
            prompts.append(chat_ids(tok, None, f"{ask}\n\n```python\n{code}\n```"))
    for passage in PASSAGES:
        for q in QUESTIONS:
            prompts.append(chat_ids(tok, None, f"Passage:\n{passage}\n\n{q}"))
    for call in TOOL_CALLS:
        for ask in JSON_ASKS:
            prompts.append(chat_ids(tok, None, f"Tool call:\n{json.dumps(call)}\n\n{ask}"))
    return prompts


def prompts_of(name: str, tok, seed: int) -> tuple[list[list[int]], int, bool]:
    """(prompts, max tokens, ignore_eos)."""
    if name == "repetitive":
        prompts = repetitive(tok)
        random.Random(seed).shuffle(prompts)
        return prompts, MAX_TOKENS, False
    rng = random.Random(seed)
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    return (
        [chat_ids(tok, None, f"{i}: " + words(rng.randint(60, 400))) for i in range(24)],
        96,
        True,
    )


# -- one load ------------------------------------------------------------------------------------


async def load(url: str, model: str, prompts, max_tokens: int, ignore_eos: bool, conc: int):
    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        await stream_completion(
            client, model, prompts[0][:64], 4, True
        )  # warm-up, outside the figures
        sem = asyncio.Semaphore(conc)

        async def run(p):
            async with sem:
                return await stream_completion(client, model, p, max_tokens, ignore_eos)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(run(p) for p in prompts))
        wall = time.perf_counter() - t0
    out = sum(r["out"] for r in results)
    decode_tokens = sum(max(0, r["out"] - 1) for r in results)
    decode_s = sum(r["e2e"] - r["ttft"] for r in results)
    return {
        "requests": len(results),
        "output_tokens": out,
        "wall_s": wall,
        "output_tok_s": out / wall,
        "decode_tok_s": decode_tokens / decode_s if decode_s else 0.0,
        "mean_output": out / len(results),
        "texts": [r["text"] for r in results],
    }


# -- systems -------------------------------------------------------------------------------------


def engine_server(args, name: str, extra: list[str]) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "engine", "serve", "--model", args.model, "--port", str(port)]
    cmd += ["--log-level", "warning", "--max-num-seqs", "64", "--kv-cache-memory-gb", "2"]
    cmd += shlex.split(args.engine_args) + extra
    log = args.log_prefix + name.replace(" ", "_") + ".log"
    return Server(name, cmd, port, thread_env(args.threads), log)


def llama_server(args, name: str, gguf: str, extra: list[str]) -> Server:
    port = free_port()
    cmd = [args.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-np", str(SLOTS), "-c", str(SLOTS * 2048), "-t", str(args.threads)]
    cmd += ["-tb", str(args.threads), "--cont-batching", "--no-webui", *extra]
    log = args.log_prefix + name.replace(" ", "_") + ".log"
    return Server(name, cmd, port, thread_env(args.threads), log)


def systems(args, gguf: str) -> list[tuple[str, object]]:
    """(name, start) in the order they run."""
    out = [("engine", lambda: engine_server(args, "engine", []))]
    for method in args.engine_spec:
        extra = ["--speculative", method, *shlex.split(args.engine_spec_args)]
        out.append((f"engine {method}", lambda e=extra, m=method: engine_server(args, m, e)))
    if args.llama_server:
        out.append(("llama-server", lambda: llama_server(args, "llama", gguf, [])))
        for spec in args.llama_spec:
            extra = ["--spec-type", *shlex.split(spec)]
            name = f"llama-server {spec}"
            out.append((name, lambda e=extra, n=name: llama_server(args, n, gguf, e)))
    return out


def table(rows: dict, workload_name: str, batch: int, label: str = "") -> None:
    own = rows.get("engine")
    llama = [s for s in rows if s.startswith("llama-server ")]
    key = "decode_tok_s" if batch == 1 else "output_tok_s"
    best = max(llama, key=lambda s: rows[s][key], default=None)
    print(f"\n{workload_name}, batch {batch}{label} ({key.replace('_', ' ')} compared):")
    print("| system | decode tok/s | output tok/s | mean output | vs engine | vs llama best |")
    print("| --- | --- | --- | --- | --- | --- |")
    for s, r in rows.items():
        vs_own = f"{r[key] / own[key]:.2f}x" if own else "-"
        vs_best = f"{r[key] / rows[best][key]:.2f}x" if best else "-"
        mark = " (best)" if s == best else ""
        print(
            f"| {s}{mark} | {r['decode_tok_s']:.1f} | {r['output_tok_s']:.1f} "
            f"| {r['mean_output']:.0f} | {vs_own} | {vs_best} |"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="default", help="a GGUF (default: SmolLM2-135M's)")
    ap.add_argument("--llama-server", default=None, help="path to a llama-server binary")
    ap.add_argument(
        "--llama-spec",
        nargs="*",
        default=["ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache"],
        help="llama-server --spec-type settings to try (each may carry its options: "
        '"ngram-simple --spec-ngram-simple-size-n 3")',
    )
    ap.add_argument("--engine-spec", nargs="*", default=["ngram", "suffix"],
                    help="our --speculative methods to run")  # fmt: skip
    ap.add_argument("--engine-spec-args", default="", help="more arguments with --speculative")
    ap.add_argument("--engine-args", default="", help="extra `engine serve` arguments (all runs)")
    ap.add_argument("--workloads", nargs="+", default=["repetitive", "chat"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--rounds", type=int, default=2, help="run each load this many times, every "
                    "system in turn each time (the order reversed every other round); figures "
                    "are the medians over the rounds")  # fmt: skip
    ap.add_argument("--threads", type=int, default=2, help="threads of every system")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--log-prefix", default="/tmp/bench_spec_", help="server logs go here")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    from engine.cpu_isa import this_cpu

    cpu = this_cpu().describe()
    print(cpu, flush=True)  # every figure below comes from this CPU
    gguf = gguf_file(args.model)
    tok = load_tokenizer(args.model)
    res: dict = {"args": vars(args), "cpu": cpu, "loads": {}}
    loads = {w: prompts_of(w, tok, args.seed) for w in args.workloads}
    servers: dict[str, Server] = {}
    try:
        for name, start in systems(args, gguf):  # all up at once: idle ones cost no CPU
            servers[name] = start()
            print(f"{name} healthy after {servers[name].start_s:.1f} s", flush=True)
        models = {name: s.model_id() for name, s in servers.items()}
        for w, (prompts, max_tokens, ignore_eos) in loads.items():
            for batch in args.batches:
                rounds = []
                for i in range(args.rounds):
                    rows = {}
                    for name in round_order(list(servers), i):
                        url = servers[name].url
                        r = asyncio.run(
                            load(url, models[name], prompts, max_tokens, ignore_eos, batch)
                        )
                        rows[name] = r
                        brief = {k: round(v, 2) for k, v in r.items() if k != "texts"}
                        print(f"{name} {w} batch {batch}: {json.dumps(brief)}", flush=True)
                    rounds.append({n: rows[n] for n in servers})
                figures = [
                    {n: {k: v for k, v in r.items() if k != "texts"} for n, r in rows.items()}
                    for rows in rounds
                ]
                med = median_over_rounds(figures)
                res["loads"][f"{w} batch {batch}"] = {"median": med, "rounds": rounds}
                table(med, w, batch, f", median of {args.rounds} rounds")
    finally:
        for s in servers.values():
            s.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
