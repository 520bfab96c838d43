"""The KV cache's dtypes (``--kv-cache-dtype``): how much they cost in quality, teacher forced
against a float32 cache, and what they save in decode time at long contexts.

    .venv/bin/python profiling/bench_kv_dtype.py quality
    .venv/bin/python profiling/bench_kv_dtype.py quality --positions 4096 8191 --window 512
    .venv/bin/python profiling/bench_kv_dtype.py decode --contexts 2048 8192 --batches 1 16
    .venv/bin/python profiling/bench_kv_dtype.py decode --contexts 8192 --batches 16 --distinct
    .venv/bin/python profiling/bench_kv_dtype.py decode --llama-batched-bench PATH
    .venv/bin/python profiling/bench_kv_dtype.py prefill --contexts 1024 8192

quality: the repository's own docs (docs/*.md and the README, in order) as one text, its first
``max(positions)`` tokens (at most the model's length less one) run once per KV dtype with
float32 activations (``prompt_logprobs=1``, so every position's logprob of the text's next
token and the model's top-1 token). For the
``window`` positions ending at each of ``positions``: top-1 agreement with the float32 cache
and perplexity (exp of the mean negative logprob) against the float32 cache's. Targets of the
long-context issue: top-1 agreement >= 97%, perplexity within 2%.

decode: time per output token (TPOT) at a context: ``batch`` requests that share one prompt of
``context`` tokens (less 40 where that is the model's length), computed once and then a prefix
hit for each (every request still reads the whole context at every step), decode 32 tokens;
TPOT is the mean over requests of (last token - first token) / 31, the engine's timestamps.
Per KV dtype, with the engine's defaults otherwise (``dtype=auto``). ``--distinct``: a prompt of
its own per request, all computed first, so that a step reads batch x context of KV (shared, one
prompt's blocks stay in the CPU's caches across the batch's rows). ``--llama-batched-bench
PATH``: llama.cpp's own at the same contexts and batches, after the engine's (llama_decode).

prefill: time to first token of a unique prompt (no prefix shared) of each length, per KV dtype.
Report the CPU beside the figures: the first line of every subcommand says it.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KV_DTYPES = ["float32", "bfloat16", "int8"]


def corpus_ids(tokenizer, n: int) -> list[int]:
    """The first n tokens of the repository's docs (README then docs/*.md by name)."""
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    text = "\n\n".join(f.read_text() for f in files)
    ids = tokenizer.encode(text)
    if len(ids) < n:
        raise SystemExit(f"the docs hold {len(ids)} tokens, fewer than {n}")
    return ids[:n]


def teacher_forced(
    kv: str, ids: list[int], quantization: str | None = None
) -> tuple[list[float], list[int]]:
    """Per position i >= 1: the logprob of ids[i] and the top-1 token, under KV dtype kv."""
    from engine import LLM, SamplingParams

    sp = SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0)
    blocks = len(ids) // 16 + 16
    with LLM(
        dtype="float32", kv_cache_dtype=kv, num_blocks=blocks, quantization=quantization
    ) as llm:
        out = llm.generate([ids], sp)[0]
    lps, top = [], []
    for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
        lps.append(entry[ids[i]].logprob)
        top.append(next(t for t, lp in entry.items() if lp.rank == 1))
    return lps, top


def cmd_quality(args: argparse.Namespace) -> None:
    from engine.bench.serve import load_tokenizer

    n = max(args.positions)
    ids = corpus_ids(load_tokenizer("default"), n)
    q = args.quantization
    runs = {}
    for kv, quant in [("float32", None)] * (q is not None) + [(kv, q) for kv in KV_DTYPES]:
        t0 = time.perf_counter()
        runs[kv, quant] = teacher_forced(kv, ids, quant)
        took = time.perf_counter() - t0
        print(f"  {kv} {quant or ''}: {n} positions in {took:.0f} s", flush=True)
    ref = runs["float32", None]
    weights = f", {q} weights against float weights" if q else ""
    print(f"\nTeacher forced over the docs, float32 activations{weights}, windows of {args.window}")
    print("| KV cache | window | top-1 agreement | perplexity | vs float32 |")
    print("| --- | --- | ---: | ---: | ---: |")
    for end in args.positions:
        lo, hi = end - args.window - 1, end - 1  # entry i predicts token i + 1
        base = math.exp(-statistics.fmean(ref[0][lo:hi]))
        for kv in KV_DTYPES:
            lps, top = runs[kv, q]
            agree = sum(a == b for a, b in zip(top[lo:hi], ref[1][lo:hi])) / (hi - lo)
            ppl = math.exp(-statistics.fmean(lps[lo:hi]))
            print(
                f"| {kv} | {end - args.window}-{end} | {agree:.1%} | {ppl:.3f} | "
                f"{ppl / base - 1:+.2%} |"
            )


def cmd_decode(args: argparse.Namespace) -> None:
    from engine import LLM, SamplingParams

    sp = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    rows, used = [], {}  # used: each context's prompt length
    for kv in args.kv_dtypes:
        for context in args.contexts:
            copies = max(args.batches) if args.distinct else 2
            blocks = (context // 16 + 4) * copies + 16 * 4
            with LLM(
                kv_cache_dtype=kv,
                num_blocks=blocks,
                max_num_seqs=max(args.batches),
                quantization=args.quantization,
                rope_scaling=args.rope_scaling,
                max_model_len=args.max_model_len,
            ) as llm:
                vocab = llm.engine.model_config.vocab_size
                n = min(context, llm.engine.max_model_len - 40)  # room for the 32 tokens
                used[context] = n
                prompts = [
                    [100 + (i * 7919 + 31 * j) % (vocab - 200) for i in range(n)]
                    for j in range(max(args.batches) if args.distinct else 1)
                ]
                llm.generate(prompts, SamplingParams(max_tokens=1))  # the prefixes, cached
                for batch in args.batches:
                    batch_prompts = prompts[:batch] if args.distinct else prompts * batch
                    outs = llm.generate(batch_prompts, sp)
                    tpot = statistics.fmean(
                        (o.metrics.last_token_time - o.metrics.first_token_time) / 31 for o in outs
                    )
                    rows.append((kv, context, batch, tpot))
                    print(f"  {kv} {context} x{batch}: {tpot * 1e3:.1f} ms", flush=True)
    llama = llama_decode(args, used) if args.llama_batched_bench else {}
    vs = " vs llama.cpp |" if llama else ""
    print(f"\n| KV cache | context | batch | TPOT | tokens/s |{vs}")
    print("| --- | ---: | ---: | ---: | ---: |" + (" ---: |" if llama else ""))
    for (context, batch), tpot in sorted(llama.items()):
        tps = batch / tpot
        print(
            f"| llama.cpp (F16) | {context} | {batch} | {tpot * 1e3:.1f} ms | {tps:.1f} | 1.00x |"
        )
    for kv, context, batch, tpot in rows:
        theirs = llama.get((context, batch))
        end = f" {tpot / theirs:.2f}x |" if theirs else (" |" if llama else "")
        print(f"| {kv} | {context} | {batch} | {tpot * 1e3:.1f} ms | {batch / tpot:.1f} |{end}")


def llama_rope_args(rope_scaling: str | None) -> list[str]:
    """--rope-scaling (the engine's JSON) as llama.cpp's flags: linear and YaRN."""
    if not rope_scaling:
        return []
    import json

    r = json.loads(rope_scaling)
    kind, factor = r.get("rope_type", r.get("type")), str(r["factor"])
    if kind == "linear":
        return ["--rope-scaling", "linear", "--rope-scale", factor]
    if kind == "yarn":
        orig = str(r.get("original_max_position_embeddings", 8192))
        return ["--rope-scaling", "yarn", "--rope-scale", factor, "--yarn-orig-ctx", orig]
    raise SystemExit(f"--llama-batched-bench: no llama.cpp flags for rope_type {kind!r}")


def llama_decode(args: argparse.Namespace, used: dict[int, int]) -> dict[tuple[int, int], float]:
    """llama.cpp's llama-batched-bench on the model's GGUF at the same contexts (the engine's
    prompt lengths, ``used``) and batches, 32 tokens, the engine's thread count, its defaults
    otherwise (F16 KV, flash attention auto): the prompt computed once (-pps) and, like the
    engine's shared prompt, one copy of its KV in a unified cache (-kvu); with --distinct a copy
    per sequence (-no-kvu), as the engine's distinct prompts read batch x context. TPOT = the
    time of its 32 batch steps / 32. {(context, batch): TPOT in seconds}."""
    import json
    import subprocess

    import torch

    from engine.bench.servers import gguf_file

    gguf, threads = gguf_file("default"), str(torch.get_num_threads())
    out: dict[tuple[int, int], float] = {}
    for context, n in used.items():
        b = max(args.batches)
        cells = (b * (n + 32) if args.distinct else n + b * 32) + 256
        cmd = [args.llama_batched_bench, "-m", gguf, "-t", threads, "-tb", threads]
        cmd += ["-c", str(cells), "-npp", str(n), "-ntg", "32", "-pps", "--output-format", "jsonl"]
        cmd += ["-npl", ",".join(str(x) for x in args.batches)]
        cmd += ["-no-kvu" if args.distinct else "-kvu", *llama_rope_args(args.rope_scaling)]
        print("  " + " ".join(cmd), flush=True)
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            raise SystemExit(f"llama-batched-bench failed ({res.returncode}): {res.stderr[-2000:]}")
        for line in (res.stdout + res.stderr).splitlines():
            if line.startswith("{") and "speed_tg" in line:
                r = json.loads(line)
                out[(context, r["pl"])] = r["t_tg"] / r["tg"]
                print(f"  llama.cpp {context} x{r['pl']}: {r['t_tg'] / r['tg'] * 1e3:.1f} ms")
    return out


def cmd_prefill(args: argparse.Namespace) -> None:
    from engine import LLM, SamplingParams

    one = SamplingParams(max_tokens=1, ignore_eos=True)
    rows = []
    for kv in args.kv_dtypes:
        blocks = max(args.contexts) // 16 + 64
        with LLM(
            kv_cache_dtype=kv,
            num_blocks=blocks,
            quantization=args.quantization,
            rope_scaling=args.rope_scaling,
            max_model_len=args.max_model_len,
        ) as llm:
            vocab = llm.engine.model_config.vocab_size
            llm.generate([list(range(100, 164))], one)  # warm-up
            for k, context in enumerate(args.contexts):
                n = min(context, llm.engine.max_model_len - 8)
                prompt = [100 + (i * 7919 + 31 * k) % (vocab - 200) for i in range(n)]
                m = llm.generate([prompt], one)[0].metrics
                rows.append((kv, n, m.first_token_time - m.arrival_time))
                print(f"  {kv} {n}: {rows[-1][2]:.2f} s", flush=True)
    print("\n| KV cache | prompt tokens | TTFT | prefill tokens/s |")
    print("| --- | ---: | ---: | ---: |")
    for kv, n, t in rows:
        print(f"| {kv} | {n} | {t:.2f} s | {n / t:.0f} |")


def main() -> None:
    from engine import cpu_isa

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("quality", help="teacher-forced agreement and perplexity vs float32 KV")
    q.add_argument("--positions", type=int, nargs="+", default=[4096, 8191])
    q.add_argument("--window", type=int, default=512)
    q.set_defaults(func=cmd_quality)
    d = sub.add_parser("decode", help="time per output token at long contexts")
    d.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    d.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    d.add_argument("--kv-dtypes", nargs="+", default=["auto", "bfloat16", "int8"])
    d.add_argument(
        "--distinct",
        action="store_true",
        help="a prompt of its own per request (each step reads batch x context of KV; without "
        "it the batch shares one prompt's blocks, which stay in the CPU's caches)",
    )
    d.add_argument(
        "--llama-batched-bench",
        metavar="PATH",
        help="llama.cpp's llama-batched-bench: the same contexts and batches on its side, in the "
        "same run, with a ratio column (docs/cpu.md builds it)",
    )
    d.set_defaults(func=cmd_decode)
    f = sub.add_parser("prefill", help="TTFT of a unique prompt per KV dtype")
    f.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    f.add_argument("--kv-dtypes", nargs="+", default=["auto", "bfloat16", "int8"])
    f.set_defaults(func=cmd_prefill)
    for p in (q, d, f):
        p.add_argument(
            "--quantization",
            choices=["int8", "w8a8"],
            help="the engine's (quality: against float weights and a float32 cache)",
        )
    for p in (d, f):  # past the model's length (docs/long-context.md)
        p.add_argument("--rope-scaling", help="JSON, as --rope-scaling of engine serve")
        p.add_argument("--max-model-len", type=int)
    args = ap.parse_args()
    print(cpu_isa.this_cpu().describe(), flush=True)
    args.func(args)


if __name__ == "__main__":
    main()
