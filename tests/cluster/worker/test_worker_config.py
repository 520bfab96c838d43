"""A worker's configuration (engine/cluster/worker/worker_config.py) is checked whole when it is
made: each rule refuses with a message that names it, and a plain prefill or decode worker and a
prefill group's stage pass."""

from __future__ import annotations

import pytest

from engine.cluster.worker.worker_config import WorkerConfig
from engine.config import EngineConfig
from engine.pipeline_stage import PipelineStage

ROUTER = "tcp://127.0.0.1:5555"
POOLED = EngineConfig(kv_pool="dram=1MiB")


def make(**kw) -> WorkerConfig:
    fields = {"role": "prefill", "router": ROUTER, "engine": EngineConfig()}
    return WorkerConfig(**{**fields, **kw})


def test_plain_workers_and_a_stage_pass():
    assert make().stage.count == 1
    assert make(role="decode", transport="tcp").transport == "tcp"
    stage = make(group="g", stage=PipelineStage(1, 2))
    assert (stage.group, stage.stage.index) == ("g", 1)


@pytest.mark.parametrize(
    "kw, why",
    [
        ({"role": "both"}, "role must be one of"),
        ({"stage": (0, 2)}, "stage must be a PipelineStage"),
        ({"group": "g"}, "needs both --group NAME and --stage I/N"),
        ({"stage": PipelineStage(0, 2)}, "needs both --group NAME and --stage I/N"),
        ({"role": "decode", "group": "g", "stage": PipelineStage(0, 2)}, "only prefill"),
        ({"group": "g" * 65, "stage": PipelineStage(0, 2)}, "group must be a name"),
        ({"group": "g", "stage": PipelineStage(0, 2), "engine": POOLED}, "without a KV pool"),
        ({"router": "127.0.0.1:5555"}, "router must be a tcp:// address"),
        ({"transport": "rdma"}, "kv_transport must be one of"),
        ({"kv_load_failure": "retry"}, "kv_load_failure must be recompute or fail"),
        ({"staging_mb": 0}, "kv_staging_mb must be >= 1"),
        ({"heartbeat_s": 0.001}, "heartbeat_s must be in"),
        ({"threads": 0}, "threads must be >= 1"),
    ],
)
def test_each_rule_refuses_with_its_reason(kw, why):
    with pytest.raises(ValueError, match=why):
        make(**kw)
