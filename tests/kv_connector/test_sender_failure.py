"""A transfer the prefill worker cannot carry on (its staging area cannot be mapped, lies outside
the arena, or a Mooncake write fails) is told to the decode worker at once with a KVAbort: the
decode worker ends it (and recomputes or fails by its policy) instead of waiting out the
transfer's deadline."""

from __future__ import annotations

import queue

import pytest
import torch

from engine.kv_connector.receiver import KVReceiver
from engine.kv_connector.sender import KVSender, SendTarget
from engine.kv_connector.staging import ARENA_PREFIX, StagingArena

L, NB, BS, H, D = 2, 8, 4, 2, 4
T = 10
DEADLINE_S = 120.0  # the receiver's own deadline: far beyond what the test waits


@pytest.mark.parametrize("fault", ["unmappable", "outside"])
def test_a_failed_send_aborts_the_transfer_at_once(fault):
    kv = torch.randn(L, 2, NB, BS, H, D)
    arena = StagingArena(1 << 20, shared=True)
    rx = KVReceiver(torch.zeros_like(kv), BS, arena)
    sender = KVSender(kv, BS)
    try:
        t = rx.expect("r", T, DEADLINE_S)
        path = f"/dev/shm/{ARENA_PREFIX}0-gone" if fault == "unmappable" else arena.path
        offset = t.offset if fault == "unmappable" else arena.nbytes  # past the arena's end
        target = SendTarget("r", "r", rx.address, "shm", path, offset, t.layout)
        sender.add(target)
        sender._send_range(target, 0, [5, 2, 7], T)
        assert target.failed
        try:
            assert rx.events.get(timeout=20) == "r"
        except queue.Empty:
            pytest.fail("the decode worker heard nothing: it would wait out its deadline")
        assert not t.ok and "the prefill worker gave up: send failed" in t.error
        assert sender.counters["failed_transfers"] == 1
    finally:
        sender.close()
        rx.close()
        arena.close()
