"""A transfer the prefill worker cannot carry on (its staging area cannot be mapped, lies outside
the arena, or a Mooncake write fails) is told to the decode worker at once with a KVAbort: the
decode worker ends it (and recomputes or fails by its policy) instead of waiting out the
transfer's deadline. A decode worker that takes nothing at all holds the sender thread once,
not once per transfer queued behind."""

from __future__ import annotations

import queue
import time

import pytest
import torch

from engine.cluster.transfer.receiver import KVReceiver
from engine.cluster.transfer.sender import KVSender, SendTarget
from engine.cluster.transfer.staging import ARENA_PREFIX, StagingArena

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


def test_sends_to_a_silent_decode_worker_do_not_each_wait_out_the_timeout():
    """A decode worker that takes nothing (partitioned: its socket's queue is full) holds the
    sender thread send_timeout once; the transfers queued behind fail at once instead of each
    waiting send_timeout too (80 s here), which held every other decode worker's transfers."""
    import socket

    kv = torch.randn(L, 2, NB, BS, H, D)
    with socket.socket() as s:  # a port nobody listens on: PUSH queues up to its HWM
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    sender = KVSender(kv, BS, send_timeout=2.0)
    arena = StagingArena(1 << 20, shared=False)
    rx = KVReceiver(torch.zeros_like(kv), BS, arena)
    layout = rx.expect("layout", T, DEADLINE_S).layout
    try:
        n = 64 + 1 + 40  # the PUSH socket's HWM, the one that times out, 40 behind it
        targets = [SendTarget(f"r{i}", f"r{i}", address, "tcp", "", 0, layout) for i in range(n)]
        start = time.monotonic()
        for target in targets:
            sender.add(target)
            sender._send_range(target, 0, [5, 2, 7], T)
        while sender.counters["failed_transfers"] < 40:  # those behind the HWM's
            assert time.monotonic() - start < 30, sender.counters  # 2 s + 40 x 2 s without
            time.sleep(0.05)
    finally:
        sender.close()
        rx.close()
        arena.close()
