"""The KV pool's copies between the paged cache and its host staging (engine/kv_connector/
pool.py): a save gathers the blocks where the cache is into host memory through the copier, a
load scatters host staging into the cache on its device. Device-side parts on a fake accelerator
(tests/fake_device.py); saves and loads round trip for real on CPU tensors, both with the CPU's
copier (gathers straight into the staging) and one that stages like a device's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from fake_device import DEVICE, fake_device

from engine.kv_connector.device_copy import DeviceCopier, HostCopier
from engine.kv_connector.pool import PoolConnector

L, NB, BS, H, D = 2, 8, 4, 2, 3


class DictStore:
    def __init__(self) -> None:
        self.blocks: dict[bytes, bytes] = {}

    def match(self, keys):
        n = 0
        while n < len(keys) and keys[n] in self.blocks:
            n += 1
        return n

    def get_into(self, key, out):
        if key not in self.blocks:
            return None
        out[:] = self.blocks[key]
        return "dram"

    def put(self, key, data, position=0):
        self.blocks[key] = bytes(data)
        return True

    def stats(self):
        return {}

    def close(self):
        pass


def test_gather_and_scatter_on_the_device():
    with fake_device():
        kv = torch.empty(L, 2, NB, BS, H, D, device=DEVICE)
        pool = PoolConnector(DictStore(), kv, BS)
    try:
        with fake_device():
            staging, ready = pool._gather([3, 1, 6])
            ready.wait()
            assert staging.device.type == "cpu" and staging.shape == (3, L, 2, BS, H, D)
            pool._scatter(torch.empty(2, L, 2, BS, H, D), [4, 0])
    finally:
        pool.close()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize(
    "device, copier",
    [
        ("cpu", HostCopier("cpu")),
        ("cpu", DeviceCopier("cpu")),
        pytest.param("cuda", None, marks=needs_cuda),  # the CUDA copier: copy stream, pinned
    ],
    ids=["host", "staged", "cuda"],
)
def test_save_then_load_round_trips(device, copier):
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(L, 2, NB, BS, H, D, generator=g).to(device)
    store = DictStore()
    pool = PoolConnector(store, kv, BS, copier=copier)
    try:
        req = SimpleNamespace(request_id="a", num_tokens=3 * BS + 1)
        hashes = [b"h0", b"h1", b"h2"]
        pool.save(req, [5, 2, 7], hashes, 0, 3)
        assert pool.flush(10.0) and len(store.blocks) == 3
        saved = kv[:, :, [5, 2, 7]].clone()
        kv.zero_()
        other = SimpleNamespace(request_id="b", num_tokens=3 * BS + 1)
        assert pool.lookup(other, hashes, 0) == 3 * BS
        pool.start_load(other, [1, 4, 6], 0, 3 * BS)
        pool.wait(10.0)
        (done,) = pool.finished_loads()
        assert done.num_tokens == 3 * BS and done.error is None
        assert torch.equal(kv[:, :, [1, 4, 6]], saved)
    finally:
        pool.close()


def test_a_load_reuses_the_last_loads_staging_buffer():
    # staging.py: a fresh buffer's page faults were most of a load's time; the second load
    # writes the first's buffer, and its blocks still arrive intact
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(L, 2, NB, BS, H, D, generator=g)
    store = DictStore()
    pool = PoolConnector(store, kv, BS)
    try:
        hashes = [b"h0", b"h1", b"h2"]
        pool.save(SimpleNamespace(request_id="s", num_tokens=3 * BS + 1), [5, 2, 7], hashes, 0, 3)
        assert pool.flush(10.0)
        saved = kv[:, :, [5, 2, 7]].clone()
        for i, (blocks, n) in enumerate([([1, 4, 6], 3), ([0, 3], 2)]):
            kv[:, :, blocks] = 0
            req = SimpleNamespace(request_id=f"r{i}", num_tokens=3 * BS + 1)
            assert pool.lookup(req, hashes, 0) == 3 * BS
            pool.start_load(req, blocks, 0, n * BS)
            pool.wait(10.0)
            (done,) = pool.finished_loads()
            assert done.num_tokens == n * BS and done.error is None
            assert torch.equal(kv[:, :, blocks], saved[:, :, :n])
        assert (pool._staging.allocated, pool._staging.reused) == (1, 1)
    finally:
        pool.close()
