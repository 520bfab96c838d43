"""A worker's configuration (``engine worker`` flags): its role, its router, its engine, where
its sockets bind, its KV transport, and, for a stage of a pipelined prefill group, the group and
the stage. Checked whole when it is made, before anything starts."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from engine.pipeline_stage import WHOLE_MODEL, PipelineStage

ROLES = ("prefill", "decode")
TRANSPORTS = ("shm", "tcp", "mooncake")


@dataclass(frozen=True)
class WorkerConfig:
    role: str
    router: str  # the router's control endpoint, tcp://HOST:PORT
    engine: EngineConfig
    worker_id: str = ""
    transport: str = "shm"  # what this decode worker offers: shm (and tcp) or tcp only
    kv_host: str = "127.0.0.1"  # where every socket other hosts reach binds (KV, events, copies)
    kv_load_failure: str = "recompute"
    staging_mb: int = 1024
    heartbeat_s: float = 0.5
    threads: int = 1  # torch threads (several workers share a host's cores)
    mooncake_metadata: str = "P2PHANDSHAKE"  # Mooncake's metadata service, for mooncake
    # A stage of a pipelined prefill group (stage_role.py): the group's name and this stage
    # (``--group NAME --stage I/N``); "" and the whole model for a prefill worker alone.
    group: str = ""
    stage: PipelineStage = WHOLE_MODEL

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.stage, PipelineStage):
            raise ValueError(f"stage must be a PipelineStage, got {self.stage!r}")
        if bool(self.group) != (self.stage.count > 1):
            raise ValueError(
                "a prefill group's worker needs both --group NAME and --stage I/N (N >= 2), "
                f"got group {self.group!r} and stage {self.stage}"
            )
        if self.group and self.role != "prefill":
            raise ValueError(f"only prefill workers form groups, not {self.role!r}")
        if self.group and not (0 < len(self.group) <= 64 and self.group.isprintable()):
            raise ValueError(f"group must be a name of 1 to 64 characters, got {self.group!r}")
        if self.group and self.engine.kv_pool:
            raise ValueError("prefill groups run without a KV pool (--kv-pool)")
        if not self.router.startswith("tcp://"):
            raise ValueError(f"router must be a tcp:// address, got {self.router!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"kv_transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.kv_load_failure not in ("recompute", "fail"):
            raise ValueError(
                f"kv_load_failure must be recompute or fail, got {self.kv_load_failure!r}"
            )
        if self.staging_mb < 1:
            raise ValueError(f"kv_staging_mb must be >= 1, got {self.staging_mb}")
        if not 0.01 <= self.heartbeat_s <= 60:
            raise ValueError(f"heartbeat_s must be in [0.01, 60], got {self.heartbeat_s}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
