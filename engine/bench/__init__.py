"""The library parts of the benchmarks, whose command lines are the scripts in profiling/ (the
layout of vLLM's ``vllm/benchmarks/``: the package holds what tests import, the scripts parse
arguments and call it).

- ``serve``: the online serving benchmark (``profiling/bench_serve.py``): its targets and
  command line; ``backends`` its OpenAI and embedded clients, ``arrivals`` when it sends each
  request, ``summary`` its figures (TTFT, TPOT, ITL and e2e latency, throughput, goodput);
- ``datasets``: its workloads (random token prompts, a Mooncake trace's shared blocks);
- ``trace``: a Mooncake trace replayed on a real cluster by placement policy
  (``profiling/bench_trace.py``, ``profiling/bench_cluster.py --trace``);
- ``pool_replay`` and ``pool_ttft``: the KV pool's trace replay and its TTFT from a pooled
  prefix (``profiling/bench_pool.py replay`` and ``ttft``);
- ``workload``: the synthetic chat prompts the offline benchmarks share; ``machine``: this
  machine's GEMV and GEMM ceilings, measured in the same run.

This package imports the engine and engine.sim (the trace format); the engine never imports it
(tests/sim/test_layering.py).
"""
