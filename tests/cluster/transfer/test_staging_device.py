"""The staging gathers and scatters on a cache that is not in host memory: every index they make
is on the cache's device (a fake accelerator, tests/fake_device.py), and the host side gets its
bytes through one explicit copy."""

from __future__ import annotations

import torch
from fake_device import DEVICE, fake_device

from engine.cluster.transfer.staging import gather_tokens, scatter_tokens
from engine.kv_connector.device_copy import DeviceCopier, HostCopier

BLOCKS, BS, HEADS, DIM = 6, 4, 2, 3


def test_gather_tokens_partial_blocks_on_the_device():
    """Tokens [1, 10) of blocks of 4: a partial block at each end, whole blocks between."""
    with fake_device():
        src = torch.empty(BLOCKS, BS, HEADS, DIM, device=DEVICE)
        table = torch.tensor([3, 0, 5]).to(DEVICE)
        out = torch.empty(9, HEADS, DIM, device=DEVICE)
        gather_tokens(src, table, 1, 10, out)
        assert out.device == DEVICE


def test_gather_into_host_through_one_copy():
    with fake_device():
        src = torch.empty(BLOCKS, BS, HEADS, DIM, device=DEVICE)
        table = DeviceCopier(DEVICE).index([3, 0, 5])
        host = torch.empty(9, HEADS, DIM)
        ready = DeviceCopier(DEVICE).fill_host(host, lambda d: gather_tokens(src, table, 1, 10, d))
        ready.wait()
        assert host.device.type == "cpu"


def test_scatter_tokens_partial_blocks_on_the_device():
    with fake_device():
        dst = torch.empty(2, 2, BLOCKS, BS, HEADS, DIM, device=DEVICE)
        table = torch.tensor([3, 0, 5]).to(DEVICE)
        staged = torch.empty(2, 2, 9, HEADS, DIM)  # host memory, as the arena is
        DeviceCopier(DEVICE).fill_device(staged, lambda s: scatter_tokens(s, dst, table, 1))


def _reference_cache() -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.arange(BLOCKS * BS * HEADS * DIM, dtype=torch.float32)
    return src.view(BLOCKS, BS, HEADS, DIM), torch.tensor([3, 0, 5])


def test_host_copier_gathers_straight_into_the_host_buffer():
    """On the CPU the gather writes the host buffer itself (no staging copy), with the same
    bytes as the device path's staging and copy."""
    src, table = _reference_cache()
    host = torch.empty(9, HEADS, DIM)
    seen = []
    HostCopier("cpu").fill_host(
        host, lambda d: (seen.append(d), gather_tokens(src, table, 1, 10, d))
    )
    assert seen[0] is host
    via_staging = torch.empty(9, HEADS, DIM)
    DeviceCopier("cpu").fill_host(via_staging, lambda d: gather_tokens(src, table, 1, 10, d))
    flat = src.view(-1, HEADS, DIM)
    slots = [table[t // BS] * BS + t % BS for t in range(1, 10)]
    assert torch.equal(host, flat[torch.tensor(slots)])
    assert torch.equal(via_staging, host)


def test_scatter_round_trip_on_the_cpu():
    src, table = _reference_cache()
    staged = torch.empty(1, 2, 9, HEADS, DIM)
    for kv in (0, 1):
        gather_tokens(src, table, 1, 10, staged[0, kv])
    dst = torch.zeros(1, 2, BLOCKS, BS, HEADS, DIM)
    DeviceCopier("cpu").fill_device(staged, lambda s: scatter_tokens(s, dst, table, 1))
    back = torch.empty(9, HEADS, DIM)
    gather_tokens(dst[0, 1], table, 1, 10, back)
    assert torch.equal(back, staged[0, 1])
