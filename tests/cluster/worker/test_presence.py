"""A worker's presence (engine/cluster/worker/presence.py), in one process with a stub engine
and role: its registration and heartbeats carry the worker's own fields and its role's; block
events reach a subscriber in runs of one kind of at most EVENT_KEYS keys, in order."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import zmq

from engine.cluster.worker.presence import REGISTER_EVERY_S, Presence
from engine.cluster.worker.worker_config import WorkerConfig
from engine.config import EngineConfig
from engine.kvstore.block_events import EVENT_KEYS, BlockEvent
from engine.pipeline_stage import PipelineStage
from engine.spec.stats import SpecStats

WAIT_S = 20.0


class StubRole:
    num_requests = 3

    def registration(self) -> dict:
        return {"kv_address": "tcp://127.0.0.1:7", "shm_path": "/x", "arena_addr": 42}

    def heartbeat(self) -> dict:
        return {"staging_used": 4096, "steps": 2, "step_s": 0.5}


def stub_engine():
    counts = SimpleNamespace(used=5)
    return SimpleNamespace(
        model_path="/models/m",
        max_model_len=256,
        metrics=SimpleNamespace(lock=threading.Lock(), finished={"stop": 1}),
        scheduler=SimpleNamespace(running=[1], waiting=[1, 2], loading=[3]),
        kv=SimpleNamespace(
            usage=lambda: 0.25,
            pool=SimpleNamespace(counts=lambda: counts),
            prefix_queries=80,
            prefix_hits=48,
        ),
        spec=SimpleNamespace(stats=SpecStats(3, 12, 7, [3, 2, 2])),  # speculative decoding's
    )


@pytest.fixture
def presence():
    cfg = WorkerConfig("prefill", "tcp://127.0.0.1:1", EngineConfig(), group="g",
                       stage=PipelineStage(1, 2))  # fmt: skip
    p = Presence(zmq.Context.instance(), cfg, "g-1")
    p.engine, p.role = stub_engine(), StubRole()  # attach() without a real engine
    yield p
    p.stop()
    p.close()


def test_registration_and_heartbeat_carry_the_worker_and_its_role(presence):
    reg = presence.register()
    assert (reg.worker_id, reg.role, reg.model) == ("g-1", "prefill", "/models/m")
    assert reg.max_model_len == 256
    assert (reg.group, reg.stage, reg.stages) == ("g", 1, 2)
    assert (reg.kv_address, reg.shm_path, reg.arena_addr) == ("tcp://127.0.0.1:7", "/x", 42)
    assert reg.events_address == presence.events_address and reg.copy_address == ""
    now = time.monotonic()
    assert not presence.register_due(now) and presence.register_due(now + REGISTER_EVERY_S)
    hb = presence.heartbeat("draining")
    assert (hb.state, hb.running, hb.waiting) == ("draining", 1, 3)
    assert (hb.kv_usage, hb.used_blocks) == (0.25, 5)
    assert (hb.transfers, hb.finished) == (3, {"stop": 1})
    assert (hb.staging_used, hb.steps, hb.step_s) == (4096, 2, 0.5)
    assert (hb.prefix_queries, hb.prefix_hits) == (80, 48)  # the router sums the prefill side's
    assert hb.spec == {
        "verifications": 3,
        "proposed": 12,
        "accepted": 7,
        "accepted_per_position": [3, 2, 2],
    }


def test_block_events_go_out_in_runs_of_one_kind(presence):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(presence.events_address)
    try:
        warm = b"w" * 32
        deadline = time.monotonic() + WAIT_S
        while not sub.poll(10):  # until the subscription is through
            assert time.monotonic() < deadline, "no block event reached the subscriber"
            presence.on_block("stored", warm)
            presence.publish_block_events()
        keys = [bytes([i % 256, i // 256]) * 16 for i in range(EVENT_KEYS + 6)]
        for k in keys[:3]:
            presence.on_block("stored", k)
        for k in keys[3:5]:
            presence.on_block("removed", k)
        for k in keys[5:]:
            presence.on_block("stored", k)
        presence.publish_block_events()
        got = []
        while len(got) < 4:
            assert sub.poll(int(WAIT_S * 1000)), f"only {len(got)} events came"
            event = BlockEvent.from_wire(sub.recv())
            if event.keys != (warm,):
                got.append(event)
    finally:
        sub.close(linger=0)
    assert [(e.kind, len(e.keys)) for e in got] == [
        ("stored", 3), ("removed", 2), ("stored", EVENT_KEYS), ("stored", 1)
    ]  # fmt: skip
    assert [k for e in got for k in e.keys] == keys
    assert {e.source for e in got} == {"g-1"}
