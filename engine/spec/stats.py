"""Speculative decoding's counters, kept by the engine and added up across a cluster's workers
(plain values: the router imports this without torch)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Counters since start: verifications (one per sequence and step with drafts), tokens
    proposed and accepted, and how many verifications kept each number of drafts."""

    verifications: int = 0
    proposed: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: kept >= i + 1 drafts
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def snapshot(self) -> dict:
        with self.lock:
            return {
                "verifications": self.verifications,
                "proposed": self.proposed,
                "accepted": self.accepted,
                "accepted_per_position": list(self.accepted_per_position),
            }


def sum_spec_stats(stats: list[dict]) -> dict:
    """The SpecStats snapshots of several engines (a cluster's workers) added up; {} if none."""
    stats = [s for s in stats if s]
    if not stats:
        return {}
    out = {k: sum(s.get(k, 0) for s in stats) for k in ("verifications", "proposed", "accepted")}
    width = max(len(s.get("accepted_per_position", ())) for s in stats)
    out["accepted_per_position"] = [
        sum(s["accepted_per_position"][i] for s in stats if i < len(s["accepted_per_position"]))
        for i in range(width)
    ]
    return out
