"""Decode load for admission: now (early rejection) and predicted (Mooncake arXiv-v3 §7).

Load is SLO satisfaction: a decode instance's estimated time between tokens divided by the TBT
SLO; the pool's load is the mean over its instances. The instance that would take the new
request has infinite load if it would pass its KV capacity or batch limit (the request would
wait, not decode).

``early`` compares the load now. Decode load lags prefill load (a request accepted now reaches
decode only when its prefill ends), so accepting and rejecting on the current load oscillates in
anti-phase. ``predicted`` evaluates the load at the moment the new request's prefill would end:
running requests whose decode will be over by then leave (each decode is assumed to take the
same time ``t_d``), and requests whose prefill will have ended by then join.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

REJECTIONS = ("none", "early", "predicted")


@dataclass
class DecodeState:
    """What the Conductor knows of one decode instance."""

    instance_id: str
    kv_capacity_tokens: int = 0  # 0: unknown, not checked
    max_batch: int = 0  # 0: not checked
    # request -> (KV tokens it will hold, decode start time)
    running: dict[str, tuple[int, float]] = field(default_factory=dict)
    # request -> (KV tokens, estimated end of its prefill): placed here, not decoding yet
    incoming: dict[str, tuple[int, float]] = field(default_factory=dict)
    running_tokens: int = 0
    incoming_tokens: int = 0
    # request -> its expected decode time, when the placement knew its output length (else the
    # prediction assumes the uniform decode time of every request)
    durations: dict[str, float] = field(default_factory=dict)

    def add_incoming(
        self, request_id: str, tokens: int, eta: float, duration: float | None = None
    ) -> None:
        self.incoming[request_id] = (tokens, eta)
        self.incoming_tokens += tokens
        if duration is not None:
            self.durations[request_id] = duration

    def delay(self, request_id: str, seconds: float) -> None:
        """A request still in prefill will join ``seconds`` later (one of higher priority went
        ahead of it in its prefill queue)."""
        entry = self.incoming.get(request_id)
        if entry is not None:
            self.incoming[request_id] = (entry[0], entry[1] + seconds)

    def start(self, request_id: str, now: float) -> None:
        entry = self.incoming.pop(request_id, None)
        if entry is not None:
            self.incoming_tokens -= entry[0]
            self.running[request_id] = (entry[0], now)
            self.running_tokens += entry[0]

    def drop(self, request_id: str) -> bool:
        self.durations.pop(request_id, None)
        entry = self.running.pop(request_id, None)
        if entry is not None:
            self.running_tokens -= entry[0]
            return True
        entry = self.incoming.pop(request_id, None)
        if entry is not None:
            self.incoming_tokens -= entry[0]
            return True
        return False

    def over_capacity(self, batch: int, tokens: int) -> bool:
        return (self.kv_capacity_tokens > 0 and tokens > self.kv_capacity_tokens) or (
            self.max_batch > 0 and batch > self.max_batch
        )


def tbt_now(state: DecodeState, predict, extra_tokens: int = 0, capacity: bool = True) -> float:
    """Estimated TBT of the instance with its running requests (and one more of
    ``extra_tokens`` if > 0); inf when that one would not fit. ``predict(batch, tokens)``
    is the TBT model; ``capacity=False`` skips the capacity check (to rank instances that are all
    full)."""
    batch = len(state.running) + (1 if extra_tokens else 0)
    tokens = state.running_tokens + extra_tokens
    if capacity and extra_tokens and state.over_capacity(batch, tokens):
        return math.inf
    return predict(batch, tokens)


def tbt_committed(
    state: DecodeState, predict, extra_tokens: int = 0, capacity: bool = True
) -> float:
    """Estimated TBT once every request placed on the instance (running or still in prefill)
    and one more of ``extra_tokens`` decode together: what the decode choice balances."""
    batch = len(state.running) + len(state.incoming) + 1
    tokens = state.running_tokens + state.incoming_tokens + extra_tokens
    if capacity and state.over_capacity(batch, tokens):
        return math.inf
    return predict(batch, tokens)


def tbt_at(
    state: DecodeState,
    predict,
    t: float,
    decode_time_s: float,
    extra_tokens: int = 0,
    capacity: bool = True,
) -> float:
    """Estimated TBT of the instance at future time ``t``: running requests that started more
    than ``decode_time_s`` (or their own expected decode time, when known) before t are gone,
    incoming ones due by t have joined."""
    batch, tokens = 0, 0
    durations = state.durations
    for rid, (n, started) in state.running.items():
        if t - started < durations.get(rid, decode_time_s):
            batch += 1
            tokens += n
    for n, eta in state.incoming.values():
        if eta <= t:
            batch += 1
            tokens += n
    if extra_tokens:
        batch += 1
        tokens += extra_tokens
    if capacity and extra_tokens and state.over_capacity(batch, tokens):
        return math.inf
    return predict(batch, tokens)


def pool_load(values: list[float], tbt_slo_s: float) -> float:
    """Mean TBT over the pool divided by the SLO (the paper's system-level load)."""
    if not values:
        return math.inf
    if any(math.isinf(v) for v in values):
        return math.inf
    return sum(values) / len(values) / tbt_slo_s
