"""The engine end to end on one device: the second half of profiling/gpu_check.sh.

    python profiling/gpu_e2e.py --model profiling/gpu_bundle/model --device cuda --out DIR
    python profiling/gpu_e2e.py --dry-run            # the steps, what each runs and checks

Each step runs in a process of its own under a deadline (a crash or hang in one is reported and
the next one runs; each starts with the device's memory free) and writes ``DIR/<step>.json``;
``DIR/e2e.md`` and ``e2e.json`` sum up, and the exit status is 1 if any step failed. The steps:

- ``env``: torch, Triton, device name, capability and memory.
- ``greedy``: greedy completions of four prompts, with logprobs and prompt logprobs, through the
  engine's kernels (Triton on CUDA) and again with ``ENGINE_KERNELS=torch`` (the references):
  tokens equal up to a near-tie of the reference, prompt logprobs within a tolerance. Also the
  first call's time (Triton compiles, unless warmed up at start) against the second's.
- ``pool``: a prompt, the device's prefix cache dropped, the prompt again: its blocks come back
  from the KV pool's DRAM tier (``num_cached_tokens``) and the tokens are the same.
- ``pd``: one prefill and one decode worker process on the one device (a router in this process,
  KV over shared memory, the layer-wise streaming path): greedy tokens equal the colocated ones.
- ``graphs``: decode steps at batch 1 and 8 with CUDA graphs and with ``enforce_eager``: tokens
  equal, time per decode step, and kernel launches per step (torch.profiler) on CUDA.

On a CPU every step runs too (graphs then measures the eager path only): tests/test_gpu_check.py
runs it on a tiny model, so the script cannot rot before a GPU is lent.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "List three colours: red,",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
)
MAX_TOKENS = 24
TIE = 0.05  # a divergence where the reference's top two differ by less than this is a near-tie
# Prompt logprobs may differ by atol + rtol * |reference| (rtol: about two units in the last
# place of the dtype's 8- or 11-bit mantissa, which the logits carry into the log-softmax).
PROMPT_LOGPROB_TOL = {"float32": (2e-3, 1e-4), "bfloat16": (0.05, 0.016), "float16": (0.02, 2e-3)}
# An int8 KV cache under 16-bit activations: a rounding that goes the other way in one of the
# two runs moves a value by a whole int8 step (max|x| / 127 of its row), which the following
# layers carry on. On the default model (30 layers, an H200, 2026-12-04) the largest difference
# was 0.15 nats against 0.10 over a bf16 cache, every token equal.
INT8_KV_ATOL = 0.2


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    runs: str
    checks: str


STEPS = (
    Step("env", "torch/triton versions, device properties", "a device is there"),
    Step(
        "greedy",
        "LLM.generate, 4 prompts x 24 tokens, logprobs 2, prompt_logprobs 1; engine kernels, then "
        "ENGINE_KERNELS=torch",
        "tokens equal but at near-ties (< 0.05 nats); prompt logprobs within a dtype's atol+rtol",
    ),
    Step(
        "pool",
        'LLM(kv_pool="dram=256MiB"): a 150-token prompt, reset_prefix_cache, the prompt again',
        "the second run loads >= 144 tokens from the pool; tokens equal",
    ),
    Step(
        "pd",
        "engine.cluster.launcher.Cluster(1 prefill, 1 decode) on the device, greedy via the router",
        "tokens equal colocated (the greedy step's engine-kernel run)",
    ),
    Step(
        "graphs",
        "LLMEngine decode at batch 1 and 8 (--decode-tokens, 64), CUDA graphs and enforce_eager",
        "tokens equal; per-step time and launches reported (CUDA graphs on CUDA only)",
    ),
    Step(
        "kvint8",
        'the greedy step with LLM(kv_cache_dtype="int8"): engine kernels, then '
        "ENGINE_KERNELS=torch",
        "tokens equal but at near-ties; prompt logprobs within bf16's atol+rtol",
    ),
    Step(
        "spec",
        'LLM(speculative_config={"method": "ngram"}): the greedy prompts, drafts verified on the '
        "device",
        "tokens equal the greedy step's (no speculation); drafts proposed and some accepted",
    ),
)


def sampling(**kw):
    from engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


def engine_config(args, **kw):
    from engine.config import CacheConfig, EngineConfig

    cache = CacheConfig(kv_cache_memory_gb=args.kv_gb)
    return EngineConfig(model=args.model, device=args.device, cache=cache, **kw)


def step_env(args) -> dict:
    import torch
    import triton

    out = {"torch": torch.__version__, "triton": triton.__version__, "device": args.device}
    out["python"] = sys.version.split()[0]
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError("--device is cuda but torch sees no GPU")
        props = torch.cuda.get_device_properties(torch.device(args.device))
        out |= {"name": props.name, "capability": f"{props.major}.{props.minor}"}
        out["memory_gib"] = round(props.total_memory / 2**30, 1)
        out["cuda"] = torch.version.cuda
    else:
        from engine.cpu_isa import this_cpu

        out["cpu"] = str(this_cpu())
    return out


def generate_all(llm, params) -> list[dict]:
    outs = llm.generate(list(PROMPTS), params)
    rows = []
    for o in outs:
        c = o.outputs[0]
        rows.append(
            {
                "tokens": list(c.token_ids),
                "text": c.text,
                "top": [{str(k): v for k, v in lp.top.items()} for lp in c.logprobs or []],
                "prompt_logprobs": [
                    None if p is None else p[tok].logprob
                    for p, tok in zip(o.prompt_logprobs or [], o.prompt_token_ids, strict=False)
                ],
            }
        )
    return rows


def step_greedy(args, **config) -> dict:
    from engine import LLM

    llm = LLM.from_config(engine_config(args, **config))
    params = sampling(logprobs=2, prompt_logprobs=1)
    t0 = time.perf_counter()
    first = generate_all(llm, params)
    t1 = time.perf_counter()
    second = generate_all(llm, params)
    t2 = time.perf_counter()
    if [r["tokens"] for r in first] != [r["tokens"] for r in second]:
        raise AssertionError("the same greedy requests gave different tokens on a second run")
    dtype = str(llm.engine.dtype).removeprefix("torch.")
    llm.close()
    return {"rows": first, "dtype": dtype, "first_s": t1 - t0, "second_s": t2 - t1}


def step_kvint8(args) -> dict:
    return {**step_greedy(args, kv_cache_dtype="int8"), "kv_dtype": "int8"}


def compare_greedy(ours: dict, ref: dict) -> dict:
    """Tokens equal up to a near-tie of the reference; prompt logprobs within tolerance."""
    ties, mismatches, worst = 0, [], -float("inf")
    atol, rtol = PROMPT_LOGPROB_TOL.get(ours["dtype"], PROMPT_LOGPROB_TOL["bfloat16"])
    if ours.get("kv_dtype") == "int8" and ours["dtype"] != "float32":
        atol = max(atol, INT8_KV_ATOL)
    for i, (a, b) in enumerate(zip(ours["rows"], ref["rows"], strict=True)):
        for pos, (x, y) in enumerate(zip(a["tokens"], b["tokens"], strict=True)):
            if x == y:
                continue
            top = b["top"][pos]
            margin = abs(top.get(str(y), 0.0) - top.get(str(x), -1e9))
            if margin < TIE:
                ties += 1
            else:
                mismatches.append({"prompt": i, "position": pos, "ours": x, "ref": y})
            break  # after a divergence the sequences differ anyway
        # The excess of each difference over its tolerance: > 0 fails.
        diffs = [
            abs(p - q) - (atol + rtol * abs(q))
            for p, q in zip(a["prompt_logprobs"], b["prompt_logprobs"], strict=True)
            if p is not None and q is not None
        ]
        worst = max([worst, *diffs])
    return {"ok": not mismatches and worst <= 0, "near_ties": ties, "mismatches": mismatches,
            "prompt_logprob_excess": worst, "atol_rtol": [atol, rtol]}  # fmt: skip


def step_pool(args) -> dict:
    from engine import LLM

    llm = LLM.from_config(engine_config(args, kv_pool="dram=256MiB"))
    prompt = " ".join(f"word{i}" for i in range(60))
    ids = llm.tokenizer.encode(prompt)[:150]
    first = llm.generate([ids], sampling())[0]
    dropped = llm.reset_prefix_cache()
    second = llm.generate([ids], sampling())[0]
    llm.close()
    out = {"prompt_tokens": len(ids), "dropped_blocks": dropped}
    out["cached_tokens"] = second.metrics.num_cached_tokens
    out["sources"] = second.metrics.kv_sources
    out["tokens_equal"] = first.outputs[0].token_ids == second.outputs[0].token_ids
    full = (len(ids) - 1) // 16 * 16  # the blocks of every prompt token but the last
    if out["cached_tokens"] < full or not out["tokens_equal"]:
        raise AssertionError(f"pool round trip: {out}")
    return out


def step_pd(args) -> dict:
    import asyncio

    import torch

    from engine.cluster.gpu_placement import worker_gpu_argv
    from engine.cluster.launcher import Cluster
    from engine.cluster.router.config import RouterConfig

    # Both workers on the one GPU, each with half the default share of its memory.
    visible = torch.cuda.device_count()
    one = 1 if visible and args.device in ("cuda", "auto") else None
    gpus = worker_gpu_argv(1, 1, visible, args.device, 0.85, one)
    worker_args = ["--model", args.model] + ([] if gpus else ["--device", args.device])
    if args.kv_gb is not None:
        worker_args += ["--kv-cache-memory-gb", str(args.kv_gb)]
    colocated = json.loads((args.out / "greedy.json").read_text())["rows"]

    async def run(router) -> list[list[int]]:
        async def one(prompt: str) -> list[int]:
            last = None
            async for out in router.generate(prompt, sampling()):
                last = out
            return list(last.outputs[0].token_ids)

        return list(await asyncio.gather(*(one(p) for p in PROMPTS)))

    t0 = time.perf_counter()
    router = RouterConfig(model=args.model)  # the router's tokenizer and limits: the same model
    with Cluster(
        1, 1, worker_args, router, worker_gpus=gpus, start_timeout=args.timeout
    ) as cluster:
        started = time.perf_counter() - t0
        tokens = asyncio.run(run(cluster.router))
    equal = [t == c["tokens"] for t, c in zip(tokens, colocated, strict=True)]
    out = {"start_s": started, "equal_colocated": equal}
    if not all(equal):
        raise AssertionError(f"1P+1D differs from colocated on prompts {equal}")
    return out


def step_graphs(args) -> dict:
    import torch

    from engine.core.llm_engine import LLMEngine

    cuda = args.device.startswith("cuda")
    modes = {"graphs": False, "eager": True} if cuda else {"eager": True}
    out: dict = {"cuda_graphs": cuda}
    tokens = {}
    # A fixed KV budget: the step builds two engines in one process, one after the other.
    kv_gb = args.kv_gb or 8.0
    for mode, eager in modes.items():
        config = engine_config(args)
        config = dataclasses.replace(
            config, cache=dataclasses.replace(config.cache, kv_cache_memory_gb=kv_gb)
        )
        if "enforce_eager" in {f.name for f in dataclasses.fields(config)}:
            config = dataclasses.replace(config, enforce_eager=eager)
        elif not eager:
            out["graphs"] = "EngineConfig has no enforce_eager: CUDA graphs not built"
            continue
        engine = LLMEngine(config)
        for batch in (1, 8):
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
            params = dataclasses.replace(sampling(), max_tokens=args.decode_tokens)
            for i, p in enumerate(prompts):
                engine.add_request(p, params, request_id=f"{mode}-{batch}-{i}")
            while engine.has_unfinished_requests() and engine.step_times.steps < 2:
                run_step(engine, tokens, mode, batch)  # prefill and the first decode
            before = dataclasses.replace(engine.step_times)
            launches = count_launches(engine, tokens, mode, batch) if cuda else None
            while engine.has_unfinished_requests():
                run_step(engine, tokens, mode, batch)
            st = engine.step_times
            steps = st.steps - before.steps
            out[f"{mode}_batch{batch}"] = {
                "decode_steps": steps,
                "forward_ms": 1e3 * (st.forward - before.forward) / max(steps, 1),
                "step_ms": 1e3 * (st.total - before.total) / max(steps, 1),
                "launches_per_step": launches,
            }
            engine.step_times = type(st)()
        engine.close()
        del engine
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            # What a closed engine leaves behind (a second LLM in one process needs it back).
            out[f"{mode}_left_gib"] = round(torch.cuda.memory_reserved() / 2**30, 2)
    if "graphs" in modes and isinstance(out.get("graphs"), str) is False and len(tokens) > 1:
        out["tokens_equal"] = tokens.get("graphs") == tokens.get("eager")
        if not out["tokens_equal"]:
            raise AssertionError("decode tokens differ with and without CUDA graphs")
    return out


def step_spec(args) -> dict:
    from engine import LLM
    from engine.config import SpeculativeConfig

    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1)
    llm = LLM.from_config(engine_config(args, speculative=spec))
    rows = generate_all(llm, sampling())
    stats = llm.engine.metrics_snapshot().spec
    llm.close()
    plain = json.loads((args.out / "greedy.json").read_text())["rows"]
    equal = [r["tokens"] == p["tokens"] for r, p in zip(rows, plain, strict=True)]
    out = {"equal_plain": equal, "spec": stats}
    if not all(equal):
        raise AssertionError(f"speculative greedy differs from plain greedy on prompts {equal}")
    return out


def run_step(engine, tokens: dict, mode: str, batch: int) -> None:
    for o in engine.step():
        if o.finished:
            tokens.setdefault(mode, {})[o.request_id.split("-", 1)[1]] = o.outputs[0].token_ids


def count_launches(engine, tokens: dict, mode: str, batch: int) -> float:
    """CUDA kernels launched per decode step over 4 steps (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            run_step(engine, tokens, mode, batch)
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    return len(kernels) / 4


STEP_FUNCS: dict[str, Callable[[argparse.Namespace], dict]] = {
    "env": step_env,
    "greedy": step_greedy,
    "pool": step_pool,
    "pd": step_pd,
    "graphs": step_graphs,
    "kvint8": step_kvint8,
    "spec": step_spec,
}
# Steps run twice, with the engine's kernels and with ENGINE_KERNELS=torch, then compared.
PAIRED = ("greedy", "kvint8")


def run_child(args, name: str, env_extra: dict[str, str], tag: str) -> dict:
    cmd = [sys.executable, __file__, "--child", name, "--model", args.model]
    cmd += ["--device", args.device, "--out", str(args.out), "--tag", tag]
    cmd += ["--timeout", str(args.timeout), "--decode-tokens", str(args.decode_tokens)]
    cmd += ["--kv-gb", str(args.kv_gb)] if args.kv_gb else []
    env = {**os.environ, **env_extra}
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=args.step_timeout
        )
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-3000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return {"ok": False, "error": f"timed out after {args.step_timeout:.0f} s", "log": tail}
    path = args.out / f"{tag}.json"
    result = json.loads(path.read_text()) if proc.returncode == 0 and path.exists() else None
    if result is None:
        return {"ok": False, "error": f"exit {proc.returncode}", "log": proc.stderr[-3000:]}
    return {"ok": True, "seconds": round(time.perf_counter() - t0, 1), **result}


def child(args) -> int:
    result = STEP_FUNCS[args.child](args)
    (args.out / f"{args.tag}.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="profiling/gpu_bundle/model")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path("profiling/results/gpu"))
    parser.add_argument("--steps", default=",".join(STEP_FUNCS), help="comma-separated")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds per step")
    parser.add_argument("--budget", type=float, default=None, help="seconds for all steps")
    parser.add_argument(
        "--decode-tokens", type=int, default=64, help="tokens per sequence in the graphs step"
    )
    parser.add_argument("--kv-gb", type=float, default=None, help="--kv-cache-memory-gb")
    parser.add_argument("--dry-run", action="store_true", help="print the steps, run nothing")
    parser.add_argument("--child", choices=list(STEP_FUNCS), help=argparse.SUPPRESS)
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    unknown = set(steps) - set(STEP_FUNCS)
    if unknown:
        parser.error(f"--steps: unknown {sorted(unknown)}; steps: {', '.join(STEP_FUNCS)}")
    if args.child:
        return child(args)
    if args.dry_run:
        print(f"would run on {args.device} with {args.model}, writing {args.out}/:")
        for s in STEPS:
            if s.name in steps:
                print(f"  e2e {s.name:7} runs {s.runs}\n              checks {s.checks}")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    deadline = time.monotonic() + (args.budget or float("inf"))
    for name in steps:
        left = deadline - time.monotonic()
        if left < 10:
            results[name] = {"ok": False, "error": f"not run: the {args.budget} s budget is spent"}
            continue
        args.step_timeout = min(args.timeout, left)
        print(f"e2e {name} ...", flush=True)
        if name in PAIRED:
            ours = run_child(args, name, {}, name)
            ref = run_child(args, name, {"ENGINE_KERNELS": "torch"}, f"{name}-torch")
            results[name] = ours
            results[f"{name}-torch"] = ref
            if ours["ok"] and ref["ok"]:
                results[f"{name}-parity"] = compare_greedy(ours, ref)
        else:
            results[name] = run_child(args, name, {}, name)
        for key in [k for k in results if k.startswith(name)]:
            r = results[key]
            print(f"  {key}: {'ok' if r.get('ok') else 'FAILED'} {summary(r)}", flush=True)
    (args.out / "e2e.json").write_text(json.dumps(results, indent=1, default=str))
    (args.out / "e2e.md").write_text(report(args, results))
    return 0 if all(r.get("ok") for r in results.values()) else 1


def summary(r: dict) -> str:
    if not r.get("ok"):
        return f"{r.get('error', '')} {r.get('mismatches', '')}".strip()
    skip = {"ok", "rows", "log"}
    return json.dumps({k: v for k, v in r.items() if k not in skip}, default=str)[:400]


def report(args, results: dict) -> str:
    lines = [f"# Engine end to end on {args.device} ({args.model})", ""]
    lines += ["| step | ok | result |", "| --- | --- | --- |"]
    for key, r in results.items():
        lines.append(f"| {key} | {'yes' if r.get('ok') else 'NO'} | {summary(r)} |")
    for key, r in results.items():
        if not r.get("ok") and r.get("log"):
            lines += ["", f"## {key}: log tail", "", "```", r["log"], "```"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
