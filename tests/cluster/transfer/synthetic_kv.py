"""A KVReceiver with synthetic layers: a small cache shape, and a sender that pushes layer pieces
whose bytes are a known function of (layer, K or V, token), as KVLayer messages over TCP frames or
written into the staging area (shared memory), in a shuffled order, then a KVDone."""

from __future__ import annotations

import random
import time

import torch
import zmq

from engine.cluster import messages as m
from engine.cluster.transfer.receiver import KVReceiver
from engine.cluster.transfer.staging import StagingArena, checksum

L, NB, BS, H, D = 3, 8, 4, 2, 4


def synthetic(transport):
    kv = torch.zeros(L, 2, NB, BS, H, D)
    arena = StagingArena(1 << 20, shared=transport == "shm")
    return kv, arena, KVReceiver(kv, BS, arena)


DONE = object()  # send_layers' default: one KVDone for every layer, with a first token


def send_layers(rx, arena, t, layers, order_seed, inline, tamper=None, rid="r", done=DONE):
    """Layers as (layer, start, end) with data = a known function of position; then ``done``
    (a KVDone, None for none, or the default: every layer's)."""
    ctx = zmq.Context.instance()
    push = ctx.socket(zmq.PUSH)
    push.connect(rx.address)
    T = t.layout.num_tokens
    full = torch.arange((L + 1) * 2 * (T + 2) * H * D, dtype=torch.float32)
    full = full.view(L + 1, 2, T + 2, H, D)
    items = list(layers)
    random.Random(order_seed).shuffle(items)
    for layer, a, b in items:
        data = full[layer, :, a:b].contiguous()
        raw = data.numpy().view("u1").reshape(-1)
        if not inline and layer < L and b <= T:  # a bad descriptor alone for the rest
            for kv in (0, 1):
                off, n = t.layout.run(layer, kv, a, b)
                arena.buf[t.offset + off : t.offset + off + n] = torch.from_numpy(
                    raw[kv * n : (kv + 1) * n].copy()
                )
        crc = checksum(raw)
        if tamper == (layer, a):
            raw = raw.copy()
            raw[0] ^= 1
            if not inline:
                arena.buf[t.offset + t.layout.run(layer, 0, a, b)[0]] ^= 1
        half = raw.nbytes // 2
        frames = (raw[:half].tobytes(), raw[half:].tobytes()) if inline else ()
        msg = m.KVLayer(rid, layer, a, b, crc, inline, frames=frames)
        push.send_multipart(m.encode(msg))
    if done is DONE:
        done = m.KVDone(rid, T, L, 0, [{"index": 0, "token": 1}])
    if done is not None:
        push.send_multipart(m.encode(done))
    push.close(linger=5000)
    return full


def wait_event(rx):
    return rx.events.get(timeout=10)


def wait_freed(arena, timeout_s: float = 10.0) -> None:
    """Wait until the arena holds nothing (a released area is freed once no sender can write)."""
    deadline = time.monotonic() + timeout_s
    while arena.used and time.monotonic() < deadline:
        time.sleep(0.01)
    assert arena.used == 0, f"{arena.used} bytes still held"
