"""Our server against its peers, one run, same load: `engine serve`, llama.cpp's `llama-server`
(when a binary is given) and HF transformers, with the machine's ceilings measured in the same run.

    .venv/bin/python profiling/bench_peer.py --llama-server /path/to/llama-server
    .venv/bin/python profiling/bench_peer.py --workloads chat --engine-args "--dtype float32"
    .venv/bin/python profiling/bench_peer.py --workloads long --skip-hf --llama-server PATH
    .venv/bin/python profiling/bench_peer.py --workloads trace trace-arrivals --skip-hf \\
        --llama-server PATH

Workloads (streamed /v1/completions over HTTP, chat-formatted prompts sent as token ids, fixed
output length with ignore_eos; warm-up requests first):

- ``chat``: 48 completions of 60-400 words, 96 output tokens each, 16 at a time.
- ``prefix``: 64 completions sharing a 1,024-token system prompt, then 50-200 words of their own,
  96 output tokens each, 16 at a time (prefix caches matter).
- ``batch1``: one request at a time, 128 output tokens: batch-1 decode speed (TPOT).
- ``long``: 2 unique prompts of about 7,100 tokens, one at a time, 32 output tokens each: the
  time to first token of an 8k prefill and the decode speed at 8k of context (not by default).
- ``long32k``: 1 unique prompt of 32,251 tokens, 32 output tokens: the same at 32k, with
  the default model's positions stretched 4x by YaRN on both servers (``--rope-scaling`` and
  ``--max-model-len 32768``; llama-server's ``--rope-scaling yarn --rope-scale 4``, one slot of
  32k). Runs alone (not by default).
- ``trace``: Mooncake's conversation trace at its real scale (512 tokens per block, its block ids
  kept: later turns share earlier turns' prefixes), the first 6 whole conversations whose turns
  all fit the default model (8,000 tokens), one request at a time in the trace's order, 32
  output tokens each (not by default).
- ``trace-arrivals``: the same turns at the trace's own concurrency: each sent at its timestamp
  in the trace, compressed ``--arrival-speedup`` times (default 4: the 6 conversations' 732 s of
  trace time become 183 s), whatever else is in flight, but not before the turn before it in its
  conversation has finished (engine/bench/trace.py send_turns says why); TTFT from the send.
  The first 6 turns all arrive at the trace's start. Not by default.

After ``trace``, a floor: the turns' multiply-accumulates (engine/bench/floor.py: projections
and exact attention past each turn's cached whole blocks) at the rate of the engine's W8A8 GEMM
measured then, the fastest products it has on the CPU class it runs as; no mean TTFT below it.

llama-server runs with the model's GGUF, 16 slots (``-np``; for ``trace-arrivals`` one per
conversation where that is more: at most one turn of each is in flight), continuous batching,
its defaults otherwise (its host prompt cache on) and the same thread count; transformers runs
float32 (its reference dtype) `generate` on padded batches of 16 (static batching; TTFT = until
its batch's first token; not for ``trace-arrivals``, which has no batches). Ratios are against
llama-server when it ran. ``--rounds N`` runs each workload N times (new prompts each time: seed +
round), llama-server and the engine in turn, the order reversed every other round, and reports
each round and the medians: on a shared machine one run of each drifts by 10-20%. Building
llama-server: see docs/cpu.md ("Comparing with llama.cpp").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import sys
import time

import httpx
import numpy as np

from engine.bench.floor import floor_line, workload_macs
from engine.bench.machine import ceilings, q8_gemm_gmac_s
from engine.bench.serve import load_tokenizer
from engine.bench.servers import Server, chat_ids, gguf_file, stream_completion, thread_env
from engine.bench.summary import median_over_rounds, round_order
from engine.bench.trace import real_scale_conversations, real_scale_turns, send_turns
from engine.bench.workload import WORDS
from engine.ipc.ports import free_port

CONCURRENCY = 16
TRACE_MAX_INPUT = 8000  # the ``trace`` workload's longest turn: the default model's 8,192 less room
# ``trace-arrivals``' default time compression. The 6 conversations' 10 turns (51,812 prompt
# tokens) span 732 s of the trace: 4x faster, 183 s, about 280 prompt tokens/s on average. One
# at a time (``trace``) the 2-core machines served the same turns in 38-166 s (the engine) and
# 145-320 s (llama-server; docs/benchmarks.md), so the offered load is 0.2-1.8x what either
# server does, on both CPU classes: concurrent, neither idle nor swamped. At 1x one server's run
# alone would take over 12 minutes.
TRACE_SPEEDUP = 4.0
ARRIVALS_SALT = 1 << 20  # trace-arrivals' block tokens differ from trace's (same seed)
LONG_BODY = 7900  # tokens of a ``long`` prompt's text (re-encoded in the chat template: ~7,100)
LONG32K_BODY = 34500  # a ``long32k`` prompt's (re-encoded in the chat template: 32,251)
YARN = '{"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 8192}'
ENGINE_32K = ["--max-model-len", "32768", "--rope-scaling", YARN]
LLAMA_32K = [
    "-c",
    "33792",
    "--rope-scaling",
    "yarn",
    "--rope-scale",
    "4",
    "--yarn-orig-ctx",
    "8192",
]


# -- workloads ------------------------------------------------------------------------------------


def trace_conversations(scale: float) -> int:
    return max(1, round(6 * scale))


def workload(name: str, tok, seed: int, scale: float):
    """(prompts, output tokens each, concurrency, turns); ``scale`` shrinks the request count.
    ``turns`` (engine/bench/trace.py Turn: the prompts with their arrivals and conversations) only
    for ``trace-arrivals``, sent at their arrivals (its concurrency: the most in flight)."""
    rng = random.Random(seed)
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    if name == "chat":
        n = max(2, round(48 * scale))
        return (
            [chat_ids(tok, None, f"{i}: " + words(rng.randint(60, 400))) for i in range(n)],
            96,
            16,
            None,
        )
    if name == "prefix":
        system = tok.decode(tok.encode(words(2048), add_special_tokens=False)[:1024])
        n = max(2, round(64 * scale))
        prompts = [chat_ids(tok, system, f"{i}: " + words(rng.randint(50, 200))) for i in range(n)]
        return prompts, 96, 16, None
    if name == "batch1":
        n = max(2, round(4 * scale))
        return [chat_ids(tok, None, f"{i}: " + words(100)) for i in range(n)], 128, 1, None
    if name == "trace":
        prompts = real_scale_conversations(trace_conversations(scale), seed, TRACE_MAX_INPUT)
        return prompts, 32, 1, None
    if name == "trace-arrivals":  # other tokens than ``trace``'s: a run of both would hit caches
        turns = real_scale_turns(trace_conversations(scale), seed + ARRIVALS_SALT, TRACE_MAX_INPUT)
        return [t.ids for t in turns], 32, len({t.conversation for t in turns}), turns
    if name == "long32k":
        body = tok.encode(words(32000), add_special_tokens=False)[:LONG32K_BODY]
        return [chat_ids(tok, None, "0: " + tok.decode(body))], 32, 1, None
    if name == "long":
        n = max(1, round(2 * scale))
        texts = [tok.decode(tok.encode(words(7000), add_special_tokens=False)[:LONG_BODY])]
        texts += [tok.decode(tok.encode(words(7000), add_special_tokens=False)[:LONG_BODY])
                  for _ in range(n - 1)]  # fmt: skip
        return [chat_ids(tok, None, f"{i}: " + t) for i, t in enumerate(texts)], 32, 1, None
    raise SystemExit(f"unknown workload {name!r}")


# -- one HTTP load --------------------------------------------------------------------------------


async def one_request(client, model: str, prompt: list[int], out_len: int) -> dict:
    return await stream_completion(client, model, prompt, out_len, ignore_eos=True)


async def http_load(
    url: str, model: str, prompts, out_len: int, concurrency: int, turns=None, speedup=1.0
) -> dict:
    # A fresh connection per request: llama-server closes idle keep-alive connections, and a
    # request sent on one that it just closed fails ("disconnected without a response").
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as client:
        await one_request(client, model, prompts[0][:64], 4)  # warm-up, outside the figures
        sem = asyncio.Semaphore(concurrency)

        async def run(p):
            async with sem:
                return await one_request(client, model, p, out_len)

        t0 = time.perf_counter()
        if turns is not None:  # at the trace's arrivals
            sent = await send_turns(turns, speedup, lambda t: one_request(client, model, t.ids,
                                                                           out_len))  # fmt: skip
            r = summarize([x for _, x in sent], time.perf_counter() - t0)
            return {**r, **arrival_figures(turns, speedup, sent)}
        results = await asyncio.gather(*(run(p) for p in prompts))
        return summarize(results, time.perf_counter() - t0)


def arrival_figures(turns, speedup: float, sent: list) -> dict:
    """How the arrivals went: turns sent later than their arrival (their conversation's earlier
    turn had not finished; more than 0.1 s), the most requests in flight at once."""
    late = sum(s > t.arrival_s / speedup + 0.1 for t, (s, _) in zip(turns, sent))
    spans = [(s, s + r["e2e"]) for s, r in sent]
    most = max(sum(a <= s < b for a, b in spans) for s, _ in spans)
    return {"held_back": late, "max_in_flight": most}


def summarize(results: list[dict], duration: float) -> dict:
    ttft = np.array([r["ttft"] for r in results])
    tpot = np.array([(r["e2e"] - r["ttft"]) / max(1, r["out"] - 1) for r in results])
    out = sum(r["out"] for r in results)
    return {
        "duration_s": duration,
        "output_tokens": out,
        "output_tok_s": out / duration,
        "ttft_mean_s": float(ttft.mean()),
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p90_s": float(np.percentile(ttft, 90)),
        "tpot_p50_ms": float(np.percentile(tpot, 50) * 1e3),
        "tpot_p90_ms": float(np.percentile(tpot, 90) * 1e3),
    }


# -- servers --------------------------------------------------------------------------------------


def start_engine(args, gguf: str, name: str = "engine", extra: str | None = None) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "engine", "serve", "--model", args.model, "--port", str(port)]
    cmd += ["--log-level", "warning", "--max-num-seqs", "64", "--kv-cache-memory-gb", "2"]
    cmd += shlex.split(args.engine_args if extra is None else extra)
    if "long32k" in args.workloads:
        cmd += ENGINE_32K
    log = args.log_prefix + name.replace(" ", "_") + ".log"
    return Server(name, cmd, port, thread_env(args.threads), log)


def start_llama(args, gguf: str) -> Server:
    port = free_port()
    cmd = [args.llama_server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port)]
    long = {"long", "trace", "trace-arrivals"} & set(args.workloads)
    per_slot = 8448 if long else 2048  # a long prompt and its output
    slots = CONCURRENCY  # trace-arrivals: at most one turn per conversation in flight
    if "trace-arrivals" in args.workloads:
        slots = max(slots, trace_conversations(args.scale))
    if "long32k" in args.workloads:  # one slot of 32k (16 would hold 12 GB of KV)
        cmd += ["-np", "1", *LLAMA_32K, "-t", str(args.threads)]
    else:
        cmd += ["-np", str(slots), "-c", str(slots * per_slot)]
        cmd += ["-t", str(args.threads)]
    cmd += ["-tb", str(args.threads), "--cont-batching", "--no-webui"]
    cmd += shlex.split(args.llama_args)
    return Server(
        "llama-server", cmd, port, thread_env(args.threads), args.log_prefix + "llama.log"
    )


# -- transformers ---------------------------------------------------------------------------------


def hf_load(gguf: str, threads: int):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    d, f = os.path.split(gguf)
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()


def hf_load_run(model, prompts, out_len: int, pad_id: int, batch: int) -> dict:
    """Static batches of ``batch`` (left-padded), one after another, all requests arriving at
    the start. A request's TTFT is the time its batch waited plus the batch's prefill (a separate
    1-token generate, kept out of the clock); its e2e is when its batch ended."""
    import torch

    results, clock = [], 0.0
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            group = prompts[i : i + batch]
            width = max(len(p) for p in group)
            ids = torch.full((len(group), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(group), width), dtype=torch.long)
            for r, p in enumerate(group):
                ids[r, width - len(p) :] = torch.tensor(p)
                mask[r, width - len(p) :] = 1
            kw = dict(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=pad_id)
            s = time.perf_counter()
            model.generate(max_new_tokens=1, **kw)
            prefill = time.perf_counter() - s
            s = time.perf_counter()
            model.generate(max_new_tokens=out_len, min_new_tokens=out_len, **kw)
            full = time.perf_counter() - s
            results += [
                {"ttft": clock + prefill, "e2e": clock + full, "out": out_len} for _ in group
            ]
            clock += full
    return summarize(results, clock)


# -- the run --------------------------------------------------------------------------------------


def param_count(gguf: str) -> int:
    from gguf import GGUFReader

    return sum(int(t.n_elements) for t in GGUFReader(gguf).tensors)


def engine_bytes_per_param(engine_args: str) -> float:
    """Bytes per weight that `engine serve` with these arguments streams per decode step: int8,
    else its weight dtype (``--weight-dtype``; under ``--dtype auto`` bf16 weights on CPUs
    without native bf16 too, engine/core/device_resolution.py resolved_weight_dtype)."""
    a = shlex.split(engine_args)
    if "--quantization" in a:
        return 1.0
    from engine.config import EngineConfig
    from engine.core.device_resolution import resolved_weight_dtype

    def opt(name: str) -> str:
        return a[a.index(name) + 1] if name in a else "auto"

    config = EngineConfig(dtype=opt("--dtype"), weight_dtype=opt("--weight-dtype"), device="cpu")
    return float(resolved_weight_dtype(config).itemsize)


def print_table(w: str, rows: dict, n: int, n_in: int, out_len: int, conc, label: str):
    print(
        f"\n{w}{label}: {n} requests, {n_in} prompt tokens, {out_len} output tokens each, "
        f"concurrency {conc}"
    )
    print(
        "| server | output tok/s | wall | TTFT mean | TTFT p50 | TTFT p90 | TPOT p50 | TPOT p90 "
        "| throughput vs llama-server | TTFT mean vs llama-server |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    base = rows.get("llama-server")
    for name, r in rows.items():
        print(fmt_row(name, r, base))
    for name, r in rows.items():
        if "max_in_flight" in r:  # trace-arrivals
            print(
                f"{name}: at most {r['max_in_flight']:g} requests in flight; {r['held_back']:g} "
                "turns sent after their arrival (their conversation's earlier turn not done)"
            )


def fmt_row(name: str, r: dict, base: dict | None) -> str:
    ratio = f"{r['output_tok_s'] / base['output_tok_s']:.2f}x" if base else "-"
    tt = f"{r['ttft_mean_s'] / base['ttft_mean_s']:.2f}x" if base else "-"
    return (
        f"| {name} | {r['output_tok_s']:.1f} | {r['duration_s']:.0f} s | {r['ttft_mean_s']:.2f} s "
        f"| {r['ttft_p50_s']:.2f} s | {r['ttft_p90_s']:.2f} s | {r['tpot_p50_ms']:.0f} ms "
        f"| {r['tpot_p90_ms']:.0f} ms | {ratio} | {tt} |"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="default", help="a GGUF (default: SmolLM2-135M's)")
    ap.add_argument("--llama-server", default=None, help="path to a llama-server binary")
    ap.add_argument("--llama-args", default="", help="extra llama-server arguments")
    ap.add_argument("--engine-args", default="", help="extra `engine serve` arguments")
    ap.add_argument("--baseline-engine-args", default=None, help="also run a second `engine "
                    "serve` with these arguments (e.g. \"--no-deterministic\"), in turn with the "
                    "others, and report the engine's ratios against it")  # fmt: skip
    ap.add_argument("--workloads", nargs="+", default=["chat", "prefix", "batch1"])
    ap.add_argument("--threads", type=int, default=2, help="threads of every system")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the request counts")
    ap.add_argument(
        "--arrival-speedup",
        type=float,
        default=TRACE_SPEEDUP,
        help=f"trace-arrivals: the trace's time compressed this many times (default "
        f"{TRACE_SPEEDUP:g})",
    )
    ap.add_argument("--skip-hf", action="store_true", help="leave transformers out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1, help="run each workload this many times, "
                    "both servers in turn each time (the order reversed every other round); "
                    "the figures and ratios are the medians over the rounds")  # fmt: skip
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--log-prefix", default="/tmp/bench_peer_", help="server logs go here")
    ap.add_argument(
        "--isa",
        choices=["avx2", "avx512", "avx512bf16", "native"],
        default=None,
        help="run this script and `engine serve` under ENGINE_CPU_ISA=ISA (give an llama-server "
        "built for the same class: docs/cpu.md)",
    )
    args = ap.parse_args()
    if not args.arrival_speedup > 0:
        ap.error(f"--arrival-speedup must be > 0, got {args.arrival_speedup}")
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if "long32k" in args.workloads and len(args.workloads) > 1:
        ap.error("--workloads long32k runs alone (its servers hold one 32k slot)")
    if args.isa and os.environ.get("ENGINE_CPU_ISA") != args.isa:
        # torch and oneDNN read their caps once, when first imported: start again under the cap
        env = {**os.environ, "ENGINE_CPU_ISA": args.isa}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    from engine.cpu_isa import this_cpu

    cpu = this_cpu().describe()
    level = this_cpu().level  # under --isa's cap: the class the engine runs as
    print(cpu, flush=True)  # every figure below comes from this CPU, under this cap

    gguf = gguf_file(args.model)
    tok = load_tokenizer(args.model)
    import torch

    torch.set_num_threads(args.threads)
    res: dict = {"args": vars(args), "cpu": cpu, "workloads": {}}
    print(f"model {gguf}\nthreads {args.threads} per system; engine args: {args.engine_args!r}")
    servers: dict[str, Server] = {}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `finally` stops the servers
    try:
        servers["engine"] = start_engine(args, gguf)
        print(f"engine serve healthy after {servers['engine'].start_s:.1f} s")
        if args.baseline_engine_args is not None:
            servers["baseline"] = start_engine(args, gguf, "baseline", args.baseline_engine_args)
            print(f"baseline engine ({args.baseline_engine_args}) healthy after "
                  f"{servers['baseline'].start_s:.1f} s")  # fmt: skip
        if args.llama_server:
            servers["llama-server"] = start_llama(args, gguf)
            print(f"llama-server healthy after {servers['llama-server'].start_s:.1f} s")
        hf = None if args.skip_hf else hf_load(gguf, args.threads)
        for w in args.workloads:
            rounds = []
            for i in range(args.rounds):
                # new prompts every round (seed + round): a repeat would hit the prefix caches
                prompts, out_len, conc, turns = workload(w, tok, args.seed + i, args.scale)
                how = conc
                if turns is not None:
                    how = (
                        f"as the trace's arrivals, {args.arrival_speedup:g}x faster "
                        f"(--arrival-speedup, default {TRACE_SPEEDUP:g}), a conversation's turns "
                        f"in order ({conc} conversations)"
                    )
                n_in = sum(len(p) for p in prompts)
                if w == "trace" and i == 0:
                    trace_prompts = prompts
                rows = {}
                # Each round both servers in turn, the order reversed every other round (ABBA):
                # on a shared machine a drift then favours neither.
                for name in round_order(["llama-server", "baseline", "engine"], i):
                    if name in servers:
                        s = servers[name]
                        r = asyncio.run(http_load(s.url, s.model_id(), prompts, out_len, conc,
                                                  turns, args.arrival_speedup))  # fmt: skip
                        rows[name] = r
                        print(f"{w} {name}: {json.dumps(r)}", flush=True)
                if hf is not None and i == 0 and turns is None:  # static batches: no arrivals
                    pad = tok.eos_token_ids[0]
                    rows["transformers fp32"] = hf_load_run(hf, prompts, out_len, pad, CONCURRENCY)
                rounds.append(rows)
                label = f" (round {i + 1} of {args.rounds})" if args.rounds > 1 else ""
                print_table(w, rows, len(prompts), n_in, out_len, how, label)
            rows = median_over_rounds(rounds)
            if args.rounds > 1:
                print_table(w, rows, len(prompts), n_in, out_len, how, " (median of rounds)")
                if "llama-server" in rows:
                    per = [r["engine"]["output_tok_s"] / r["llama-server"]["output_tok_s"]
                           for r in rounds]  # fmt: skip
                    dec = [r["llama-server"]["tpot_p50_ms"] / r["engine"]["tpot_p50_ms"]
                           for r in rounds]  # fmt: skip
                    per_s = ", ".join(f"{x:.2f}x" for x in per)
                    dec_s = ", ".join(f"{x:.2f}x" for x in dec)
                    print(f"{w} per round: throughput {per_s}; decode (1/TPOT p50) {dec_s}")
            res["workloads"][w] = rows
            res.setdefault("rounds", {})[w] = rounds
    finally:
        for s in servers.values():
            s.stop()
    ceil = ceilings()
    res["ceilings"] = ceil
    params = param_count(gguf)
    bpp = engine_bytes_per_param(args.engine_args)
    gemv = ceil["gemv_gb_s_torch.bfloat16" if bpp <= 2 else "gemv_gb_s_torch.float32"]
    floor = gemv * 1e9 / (params * bpp)
    res["batch1_floor_tok_s"] = floor
    print(
        f"\nmachine now: GEMV {ceil['gemv_gb_s_torch.float32']:.1f} GB/s fp32, "
        f"{ceil['gemv_gb_s_torch.bfloat16']:.1f} GB/s bf16; GEMM "
        f"{ceil['gemm_gflop_s_torch.float32']:.0f} GFLOP/s fp32, "
        f"{ceil['gemm_gflop_s_torch.bfloat16']:.0f} GFLOP/s bf16"
    )
    print(
        f"batch-1 decode floor of the engine's weights ({params / 1e6:.0f} M params x {bpp:g} "
        f"bytes at the GEMV bandwidth): {floor:.1f} tok/s"
    )
    trace = res["workloads"].get("trace")
    q8 = q8_gemm_gmac_s() if trace else None
    if q8:  # the least mean TTFT the trace allows at the engine's fastest products
        from engine.config import CacheConfig
        from engine.model.gguf_loader import config_from_gguf, read_gguf

        block = CacheConfig().block_size  # the engine's, its prefix cache's unit
        a = shlex.split(args.engine_args)
        for i, t in enumerate(a):
            if t == "--block-size" and i + 1 < len(a):
                block = int(a[i + 1])
            elif t.startswith("--block-size="):
                block = int(t.split("=", 1)[1])
        cfg = config_from_gguf(*read_gguf(gguf), gguf)
        macs = workload_macs(cfg, trace_prompts, block)
        peer = trace.get("llama-server", {}).get("ttft_mean_s")
        print(floor_line(macs, q8[0], f"the engine's W8A8 GEMM rate now ({q8[1]})", peer))
    b1 = res["workloads"].get("batch1", {})
    for name, r in b1.items():
        print(f"batch-1 decode {name}: {1e3 / r['tpot_p50_ms']:.1f} tok/s")
    if "chat" in res["workloads"] and "llama-server" in res["workloads"]["chat"]:
        c = res["workloads"]["chat"]
        e, lcpp = c["engine"], c["llama-server"]
        # The AVX2 class's target (capped or an AVX2-only CPU), else AVX-512's
        want = "1.5x" if level in ("none", "avx2") else "2x"
        print(
            f"targets (chat): throughput {e['output_tok_s'] / lcpp['output_tok_s']:.2f}x "
            f"(>= {want}), TTFT p50 {e['ttft_p50_s'] / lcpp['ttft_p50_s']:.2f}x (<= 0.5x)"
        )
    if "engine" in b1 and "llama-server" in b1:
        speed = b1["llama-server"]["tpot_p50_ms"] / b1["engine"]["tpot_p50_ms"]
        print(f"target (batch 1): decode {speed:.2f}x llama-server's (>= 1x)")
    if args.baseline_engine_args is not None:
        print(f"\nthe engine against the baseline ({args.baseline_engine_args}), medians:")
        for w, rows in res["workloads"].items():
            e, b = rows["engine"], rows["baseline"]
            print(
                f"{w}: throughput {e['output_tok_s'] / b['output_tok_s']:.2f}x, "
                f"TTFT p50 {e['ttft_p50_s'] / b['ttft_p50_s']:.2f}x (time), "
                f"decode (1/TPOT p50) {b['tpot_p50_ms'] / e['tpot_p50_ms']:.2f}x"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
