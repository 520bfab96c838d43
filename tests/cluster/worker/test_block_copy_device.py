"""Block copies on a cache that is not in host memory (engine/cluster/worker/block_copy.py): the
blocks are gathered where the cache is and copied to the host once before their bytes are taken,
and copied blocks go to the cache's device before they are written. Device-side parts on a fake
accelerator (tests/fake_device.py); tests/cluster/worker/test_block_copy.py runs the whole copy on
CPU tensors."""

from __future__ import annotations

import torch
from fake_device import DEVICE, fake_device

from engine.cluster.worker.block_copy import read_blocks, write_blocks


def test_read_blocks_copies_device_blocks_to_the_host():
    with fake_device():
        kv = torch.empty(3, 2, 16, 4, 2, 4, device=DEVICE)
        data = read_blocks(kv, [7, 2])
        assert data.device.type == "cpu" and data.shape == (3, 2, 2, 4, 2, 4)
        assert data.is_contiguous()  # its bytes are taken as they lie


def test_write_blocks_moves_host_data_to_the_device():
    with fake_device():
        kv = torch.empty(3, 2, 16, 4, 2, 4, device=DEVICE)
        write_blocks(kv, [7, 2], torch.empty(3, 2, 2, 4, 2, 4))


def test_read_and_write_blocks_on_the_cpu():
    kv = torch.randn(3, 2, 16, 4, 2, 4)
    data = read_blocks(kv, [7, 2])
    assert torch.equal(data, kv[:, :, [7, 2]])
    write_blocks(kv, [0, 1], data)
    assert torch.equal(kv[:, :, [0, 1]], kv[:, :, [7, 2]])
