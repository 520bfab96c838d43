"""Priority scheduling under overload: high-priority TTFT p90 under ``engine serve
--scheduling-policy priority`` against the same requests under fcfs; ``--help`` shows the usage.
The benchmark is engine/bench/priority.py.

    .venv/bin/python profiling/bench_priority.py --rounds 2
"""

import sys

from engine.bench.priority import main

if __name__ == "__main__":
    sys.exit(main())
