"""Chunked pipeline parallelism on this host: time to first token of long prompts prefilled by a
pipelined prefill group of ``--stages`` worker processes against one prefill worker, each process
on one torch thread (issue 22's target: a 2-stage group at <= 0.6x of one worker at 3.5k and 7k
tokens; the ideal is 1/N plus the pipeline's fill).

Three clusters run side by side, each with one decode worker, and take turns prompt by prompt
(so a change of the host's load hits them alike); every prompt is fresh random tokens (no prefix
hit anywhere), ``max_tokens=1``, streamed, warm:

- ``single``: one prefill worker with its defaults (``--max-num-batched-tokens``: 1024 on the CPU);
- ``single@chunk``: one prefill worker whose prefill budget is the group's chunk, the same work
  in the same pieces as the group (the reference for the bubble);
- ``group``: ``--prefill 0 --prefill-groups 1 --stages N``, chunks of ``--chunk`` tokens.

The table gives the medians (min-max), the group's ratio to both, its bubble (TTFT beyond a
perfect split of single@chunk's time over the stages, as a share of that split) and the
stage-boundary traffic: the hidden-state bytes the stages sent each other for the prompt, as
their heartbeats report them (router /health, ``hidden_bytes_sent``), per prompt.

    .venv/bin/python profiling/bench_pipeline.py                         # 3584 and 7168 tokens
    .venv/bin/python profiling/bench_pipeline.py --sizes 2048 --repeats 2 --stages 2
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import time

import numpy as np

from engine.sampling_params import SamplingParams


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


async def ttft(router, prompt: list[int]) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1)
    t0 = time.monotonic()
    async for _ in router.generate(prompt, params):
        return time.monotonic() - t0
    return float("nan")


def hidden_bytes(router) -> int:
    return sum(w.get("hidden_bytes_sent", 0) for w in router.workers_status().values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="3584,7168", help="prompt lengths, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=256, help="the group's chunk (prefill budget)")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    from engine.cluster.launcher import Cluster
    from engine.cluster.router.router import RouterConfig
    from engine.cpu_isa import this_cpu

    common = ["--dtype", args.dtype, "--kv-cache-memory-gb", "1", "--kv-staging-mb", "1024",
              "--max-model-len", "8192", "--log-level", "warning"]  # fmt: skip
    chunked = [*common, "--max-num-batched-tokens", str(args.chunk)]
    # Placement has one choice; no refusal (--rejection none still refuses past the TTFT SLO).
    router = RouterConfig(rejection="none", ttft_slo_s=1e6)
    rng = np.random.default_rng(7)
    prompts = {
        s: [rng.integers(100, 40000, s).tolist() for _ in range(args.repeats)] for s in sizes
    }
    times: dict[str, dict[int, list[float]]] = {"single": {}, "single@chunk": {}, "group": {}}
    traffic: dict[int, list[int]] = {}
    with (
        Cluster(1, 1, worker_args=common, router_config=router, threads=1) as single,
        Cluster(1, 1, worker_args=chunked, router_config=router, threads=1) as single_chunk,
        Cluster(
            0,
            1,
            worker_args=chunked,
            router_config=router,
            threads=1,
            prefill_groups=1,
            stages=args.stages,
        ) as group,  # fmt: skip
    ):
        systems = {"single": single.router, "single@chunk": single_chunk.router,
                   "group": group.router}  # fmt: skip

        async def run() -> None:
            for r in systems.values():  # warm-up: first-forward allocations, connections
                await ttft(r, rng.integers(100, 40000, 600).tolist())
            for i in range(args.repeats):
                for s in sizes:
                    for name, r in systems.items():
                        before = hidden_bytes(r) if name == "group" else 0
                        times[name].setdefault(s, []).append(await ttft(r, prompts[s][i]))
                        if name == "group":
                            await asyncio.sleep(1.2)  # the stages' next heartbeats
                            traffic.setdefault(s, []).append(hidden_bytes(r) - before)

        asyncio.run(run())

    isa = this_cpu()
    print(f"\nCPU: {cpu_model()}; {isa.describe()}")
    print(
        f"TTFT (s), one request at a time, median of {args.repeats} (min-max); group: "
        f"{args.stages} stages, chunks of {args.chunk}; one torch thread per process\n"
    )
    print("| tokens | single | single@chunk | group | group / single | group / single@chunk "
          "| bubble | boundary traffic |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in sizes:
        a, c, g = (np.array(times[n][s]) for n in ("single", "single@chunk", "group"))
        split = np.median(c) / args.stages
        bubble = (np.median(g) - split) / split
        mib = np.median(traffic[s]) / 2**20

        def cell(x: np.ndarray) -> str:
            return f"{np.median(x):.2f} ({x.min():.2f}-{x.max():.2f})"

        print(
            f"| {s} | {cell(a)} | {cell(c)} | {cell(g)} | {np.median(g) / np.median(a):.2f}x "
            f"| {np.median(g) / np.median(c):.2f}x | {bubble:.2f} | {mib:.1f} MiB |"
        )


if __name__ == "__main__":
    main()
