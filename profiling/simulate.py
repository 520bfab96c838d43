"""Replay a Mooncake-format trace on a simulated cluster driven by the real Conductor.

    python profiling/simulate.py --prefill 8 --decode 8 --policy kvcentric --rejection predicted \\
        --speed 1.0 --json     # the Mooncake trace in data/traces/ unless --trace FILE

The simulator and this command live in engine/sim/ (simulator.py, simulate.py); see
engine/sim/simulate.py for what is printed.
"""

import sys

from engine.sim.simulate import main

if __name__ == "__main__":
    sys.exit(main())
