"""The router's typed configuration and the error a client sees when the cluster cannot serve."""

from __future__ import annotations

from dataclasses import dataclass

from engine.async_llm import EngineDeadError
from engine.config import SCHEDULING_POLICIES


class ClusterUnavailableError(EngineDeadError):
    """No live worker can take the request, or its worker died (HTTP 503)."""


@dataclass(frozen=True)
class RouterConfig:
    address: str = "tcp://127.0.0.1:0"
    model: str = "default"
    max_model_len: int | None = None  # None: the smallest the workers register with
    heartbeat_timeout_s: float = 5.0
    phase_timeout_s: float = 60.0  # decode reservation; first token after placement
    transfer_deadline_s: float = 120.0  # the decode worker's wait for KV (then its policy)
    request_timeout_s: float = 3600.0
    max_retries: int = 2
    max_pending: int = 4096
    kv_transport: str | None = None  # None: shm for pairs proven to share /dev/shm, else tcp
    stream_layers: bool = True
    # The Conductor's placement (conductor_placement.make_placement validates these).
    policy: str = "kvcentric"
    rejection: str = "predicted"
    ttft_slo_s: float = 30.0
    # Not the paper's 0.1 s (its 70B model on GPUs): SmolLM2 on one CPU thread takes 50 to
    # 150 ms a decode step alone, and the Conductor learns the real step times (heartbeats), so
    # a 0.1 s default would refuse most requests on a CPU cluster.
    tbt_slo_s: float = 1.0
    block_size: int = 16  # the workers' KV block size: prompts are hashed as they hash them
    # How long a prefill waits for the block copy the Conductor planned before it (then it runs
    # and recomputes what did not arrive).
    copy_timeout_s: float = 2.0
    # "fcfs": requests must carry priority 0 (else a 400 naming it); "priority": the Conductor
    # orders its prefill queues by (priority, arrival) and the workers (engine cluster gives them
    # this policy) order theirs (docs/cluster.md "Priorities").
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        for name in (
            "copy_timeout_s",
            "heartbeat_timeout_s",
            "phase_timeout_s",
            "transfer_deadline_s",
            "request_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                "scheduling_policy (--scheduling-policy) must be one of "
                f"{', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}"
            )
        if self.kv_transport not in (None, "shm", "tcp", "mooncake"):
            raise ValueError(
                f"kv_transport must be shm, tcp or mooncake, got {self.kv_transport!r}"
            )
