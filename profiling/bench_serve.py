"""Online serving benchmark in the shape of ``vllm bench serve`` (TTFT, TPOT, ITL, e2e latency,
throughput, goodput); ``--help`` shows the usage. The benchmark is engine/bench/serve.py, its
clients engine/bench/backends.py, its arrivals engine/bench/arrivals.py, its figures
engine/bench/summary.py, its workloads engine/bench/datasets.py.
"""

import sys

from engine.bench.serve import main

if __name__ == "__main__":
    sys.exit(main())
