"""Metrics the engine keeps itself (the servers export them; the core imports no exporter)."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

# Buckets in seconds, as vLLM's histograms use.
# fmt: off
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)
# fmt: on


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, last = +Inf
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, cumulative count) pairs ending with (inf, count), Prometheus style."""
        out, running = [], 0
        for bound, c in zip((*self.buckets, float("inf")), self.counts):
            running += c
            out.append((bound, running))
        return out


@dataclass
class EngineMetrics:
    """Counters and histograms; gauges (running, waiting, KV usage) are read live by snapshot()."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    computed_prompt_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> count
    rejected: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def snapshot(
        self,
        num_running: int,
        num_waiting: int,
        kv_usage: float,
        num_blocks: int = 0,
        prefix_queries: int = 0,
        prefix_hits: int = 0,
        preemptions: int = 0,
        kv_pool: dict | None = None,
        spec: dict | None = None,
    ) -> MetricsSnapshot:
        """The counters and histograms now, with the gauges the caller reads live."""
        with self.lock:
            return MetricsSnapshot(
                num_running=num_running,
                num_waiting=num_waiting,
                kv_usage=kv_usage,
                num_blocks=num_blocks,
                prefix_queries=prefix_queries,
                prefix_hits=prefix_hits,
                preemptions=preemptions,
                prompt_tokens=self.prompt_tokens,
                generation_tokens=self.generation_tokens,
                computed_prompt_tokens=self.computed_prompt_tokens,
                finished=dict(self.finished),
                rejected=self.rejected,
                ttft=self.ttft.cumulative(),
                ttft_sum=self.ttft.total,
                itl=self.itl.cumulative(),
                itl_sum=self.itl.total,
                e2e=self.e2e.cumulative(),
                e2e_sum=self.e2e.total,
                queue_time=self.queue_time.cumulative(),
                queue_time_sum=self.queue_time.total,
                kv_pool=kv_pool or {},
                spec=spec or {},
            )


@dataclass
class StepTimes:
    """Cumulative wall time of the parts of engine steps: scheduling and input preparation,
    the model forward (with logits), sampling, and output processing. Benchmarks read it to
    report scheduler overhead as a share of step time."""

    steps: int = 0
    schedule: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    process: float = 0.0

    def add(self, schedule: float, forward: float, sample: float, process: float) -> None:
        self.steps += 1
        self.schedule += schedule
        self.forward += forward
        self.sample += sample
        self.process += process

    @property
    def total(self) -> float:
        return self.schedule + self.forward + self.sample + self.process


@dataclass(frozen=True)
class MetricsSnapshot:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_blocks: int
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    prompt_tokens: int
    generation_tokens: int
    computed_prompt_tokens: int
    finished: dict[str, int]
    rejected: int
    ttft: list[tuple[float, int]]
    ttft_sum: float
    itl: list[tuple[float, int]]
    itl_sum: float
    e2e: list[tuple[float, int]]
    e2e_sum: float
    queue_time: list[tuple[float, int]]
    queue_time_sum: float
    kv_pool: dict = field(default_factory=dict)  # the KV connector's stats, when there is one
    # Speculative decoding's counters (engine/spec/decoder.py SpecStats), when it is on.
    spec: dict = field(default_factory=dict)
