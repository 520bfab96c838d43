"""The P/D transfer on a cache that is not in host memory: the sender gathers each layer on the
cache's device and copies it to host memory once (into the decode worker's staging area, or a
send buffer), the receiver copies staged KV to the device before scattering it. Device-side parts
run on a fake accelerator (tests/fake_device.py); the host side of the same path (the copy's
bytes hashed by the sender thread once they are ready, not on the engine thread) runs for real
on CPU tensors through a copier that stages like a device's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from fake_device import DEVICE, fake_device

from engine.cluster import messages as m
from engine.cluster.transfer.receiver import KVReceiver
from engine.cluster.transfer.sender import KVSender, SendTarget
from engine.cluster.transfer.staging import KVLayout, StagingArena, gather_tokens
from engine.kv_connector.device_copy import DeviceCopier, Ready

L, NB, BS, H, D = 3, 8, 4, 2, 4
TABLE = [5, 2, 7]  # tokens 0-3 -> block 5, 4-7 -> 2, 8-9 -> 7
T = 10


def layout() -> KVLayout:
    return KVLayout(L, T, H * D * 4)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_sender_gathers_a_device_layer_into_host_memory(transport):
    """Tokens [1, 10) of layer 1: partial blocks at both ends. The gather runs on the device and
    the host buffer is filled by one copy; the checksum waits for the sender thread."""
    arena = StagingArena(1 << 20, shared=True)
    items = []
    with fake_device():
        kv = torch.empty(L, 2, NB, BS, H, D, device=DEVICE)
        sender = KVSender(kv, BS)
    try:
        sender._put = lambda t, item: items.append(item)
        target = SendTarget("r", "r", "tcp://127.0.0.1:1", transport, arena.path, 0, layout())
        sender.add(target)
        sender._peers.get(arena.path)  # mapped outside the fake mode: a real file
        with fake_device():
            target.sent[1] = 1
            sender._send_range(target, 1, TABLE, T)
        assert not target.failed
        (item,) = items
        kind, _, layer, start, end, bufs, crc, ready = item
        assert (kind, layer, start, end) == ("layer", 1, 1, T)
        assert all(b.device.type == "cpu" for b in bufs)
        assert crc is None and ready is not None  # hashed by the sender thread
    finally:
        sender.close()
        arena.close()


def test_receiver_copies_staged_kv_to_the_device_before_the_scatter():
    arena = StagingArena(1 << 20, shared=False)
    with fake_device():
        kv = torch.empty(L, 2, NB, BS, H, D, device=DEVICE)
        rx = KVReceiver(kv, BS, arena)
    try:
        t = rx.expect("r", T, 30.0)
        with fake_device():
            rx._scatter(t, TABLE, 1, T - 1)  # a partial block at both ends
    finally:
        rx.close()
        arena.close()


class WaitedCopier(DeviceCopier):
    """A device's copies, on CPU tensors: staged, then one copy; counts the waits."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.waits = 0

    def fill_host(self, dst, produce) -> Ready:
        super().fill_host(dst, produce)
        copier = self

        class Waited:
            def wait(self) -> None:
                copier.waits += 1

        return Waited()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_a_staged_copy_is_hashed_by_the_sender_thread_and_arrives_intact(transport, device):
    """The whole transfer with a copier that stages like a device's (on a GPU: the CUDA copier,
    copy stream and events): the receiver checks every layer's checksum, which the sender took
    after waiting for the copy, and loads the staged KV into the cache."""
    g = torch.Generator().manual_seed(0)
    src = torch.randn(L, 2, NB, BS, H, D, generator=g).to(device)
    dst = torch.zeros(L, 2, NB, BS, H, D, device=device)
    arena = StagingArena(1 << 20, shared=transport == "shm")
    copier = WaitedCopier() if device == "cpu" else None
    rx = KVReceiver(dst, BS, arena, remote_writes=transport != "tcp")
    sender = KVSender(src, BS, copier=copier)
    try:
        t = rx.expect("r", T, 30.0)
        target = SendTarget("r", "r", rx.address, transport, arena.path, t.offset, t.layout)
        sender.add(target)
        for layer in range(L):
            sender._send_range(target, layer, TABLE, 6)
            sender._send_range(target, layer, TABLE, T)
        sender.finish("r", m.KVDone("r", T, L, 0, [{"index": 0, "token": 1}]))
        assert rx.events.get(timeout=10) == "r"
        assert t.ok, t.error
        assert copier is None or copier.waits == 2 * L  # each piece waited for before its hash
        staged = arena.view(t.offset, t.layout.nbytes).view(torch.float32).view(L, 2, T, H, D)
        want = torch.empty(T, H, D)
        host = src.cpu()
        for layer in range(L):
            for kv in (0, 1):
                gather_tokens(host[layer, kv], torch.tensor(TABLE), 0, T, want)
                assert torch.equal(staged[layer, kv], want)
        rx.admit("r", ["r"])
        req = SimpleNamespace(request_id="r", num_tokens=T + 1)
        assert rx.lookup(req, [], 0) == T
        rx.start_load(req, [1, 4, 6], 0, T)
        (done,) = rx.finished_loads()
        assert done.error is None
        loaded = torch.empty(T, H, D)
        for layer in range(L):
            for kv in (0, 1):
                gather_tokens(dst[layer, kv].cpu(), torch.tensor([1, 4, 6]), 0, T, loaded)
                assert torch.equal(loaded, staged[layer, kv])
    finally:
        sender.close()
        rx.close()
        arena.close()
