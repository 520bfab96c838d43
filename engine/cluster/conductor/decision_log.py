"""The Conductor's recent decisions, for the dashboard (engine/server/dashboard/): a bounded ring
of the last ``DECISION_LOG_SIZE`` placements and rejections, each with its wall-clock time, the
request (the router's id once ``bind`` names it, else the placement's own), the chosen workers or
the rejection's reason, and the predicted TTFT and TBT.

Written by the router's IO thread, read by the HTTP server's: a lock guards the ring, and readers
get copies.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable

from engine.cluster.conductor.decision import Decision

DECISION_LOG_SIZE = 100


def _finite(x: float) -> float | None:
    return round(x, 6) if math.isfinite(x) else None  # JSON has no infinity


class DecisionLog:
    def __init__(self, size: int = DECISION_LOG_SIZE, clock: Callable[[], float] = time.time):
        if size < 1:
            raise ValueError(f"size must be at least 1, got {size}")
        self._ring: deque[dict] = deque(maxlen=size)
        self._lock = threading.Lock()
        self._clock = clock

    def record(self, d: Decision) -> None:
        entry = {
            "time": self._clock(),
            "request_id": d.request_id,
            "accepted": d.accepted,
            "prefill": d.prefill,
            "decode": d.decode,
            "prefix_blocks": d.prefix_blocks,
            "copies": len(d.copies),
            "est_ttft_s": _finite(d.est_ttft_s),
            "est_tbt_s": _finite(d.est_tbt_s),
            "reason": d.reason,
        }
        with self._lock:
            self._ring.append(entry)

    def name_last(self, request_id: str) -> None:
        """The router's id for the decision recorded last (``Placement.bind``)."""
        with self._lock:
            if self._ring:
                self._ring[-1]["request_id"] = request_id

    def snapshot(self) -> list[dict]:
        """Oldest first, copies (any thread)."""
        with self._lock:
            return [dict(e) for e in self._ring]
