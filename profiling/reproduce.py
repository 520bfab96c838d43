"""Reproduce the Mooncake papers' scheduling results on the simulated cluster (``make reproduce``):
writes docs/reproduction.md and its plots under docs/figures/. The command's body is
engine/sim/reproduce.py (the experiments are in engine/sim/experiments.py, the plots in
engine/sim/plots.py, the document in engine/sim/report.py); ``--quick`` runs each on the first
10 minutes of the trace.
"""

import sys

from engine.sim.reproduce import main

if __name__ == "__main__":
    sys.exit(main())
