"""Decode step times a decode worker reports in its heartbeats, for the Conductor's
time-between-tokens model (conductor.py, time_models.TbtModel).

The engine thread adds one sample per step (seconds, running requests, KV tokens they hold);
the heartbeat thread takes the means since its last take. The TBT model is linear in batch and
tokens, so the mean of the steps' times is the model's time at their mean batch and tokens: one
report per heartbeat loses nothing the fit uses.
"""

from __future__ import annotations

import threading
from typing import NamedTuple


class StepMeans(NamedTuple):
    steps: int
    step_s: float
    batch: float
    tokens: float


class StepStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n = 0
        self._s = self._b = self._t = 0.0

    def add(self, seconds: float, batch: int, tokens: int) -> None:
        if batch <= 0 or not seconds > 0:
            return  # an idle step (only KV loads in flight) says nothing of decode time
        with self._lock:
            self._n += 1
            self._s += seconds
            self._b += batch
            self._t += tokens

    def take(self) -> StepMeans:
        with self._lock:
            n, s, b, t = self._n, self._s, self._b, self._t
            self._n, self._s, self._b, self._t = 0, 0.0, 0.0, 0.0
        if n == 0:
            return StepMeans(0, 0.0, 0.0, 0.0)
        return StepMeans(n, s / n, b / n, t / n)
