"""A Mooncake trace replayed on a real cluster, by placement policy (also
``profiling/bench_cluster.py --trace``); ``--help`` shows the usage. The benchmark is
engine/bench/trace.py.
"""

from engine.bench.trace import main

if __name__ == "__main__":
    main()
