"""The copier of each cache device (engine/kv_connector/device_copy.py): the CPU's copies are
the plain host work of before (nothing pinned, nothing staged, nothing waits); a device's go
through a device staging tensor and one explicit copy; CUDA's run on a copy stream ordered by
events against the forward's stream, into pinned memory. No GPU here: the CUDA copier runs on a
fake accelerator (tests/fake_device.py) with a stand-in for ``torch.cuda`` that records the
stream and event calls."""

from __future__ import annotations

import pytest
import torch
from fake_device import DEVICE, fake_device

from engine.kv_connector import device_copy
from engine.kv_connector.device_copy import (
    CudaCopier,
    DeviceCopier,
    HostCopier,
    make_copier,
)


def test_the_copier_follows_the_cache_device():
    cpu = make_copier(torch.device("cpu"))
    assert type(cpu) is HostCopier and cpu.on_host and not cpu.pinned
    cuda = make_copier("cuda:0")  # choosing it needs no GPU: its stream is made on first use
    assert type(cuda) is CudaCopier and cuda.pinned and not cuda.on_host
    other = make_copier(DEVICE)
    assert type(other) is DeviceCopier and not other.pinned and not other.on_host


def test_host_copier_pins_nothing_and_waits_for_nothing():
    c = HostCopier("cpu")
    buf = c.host_empty((2, 3), torch.float16)
    assert buf.dtype == torch.float16 and buf.device.type == "cpu" and not buf.is_pinned()
    assert c.register(buf) is False
    seen = []
    c.fill_device(buf, seen.append)
    assert seen[0] is buf  # the scatter reads the host tensor itself
    assert c.index([3, 1]).tolist() == [3, 1]


def test_only_the_cuda_copier_asks_for_pinned_buffers(monkeypatch):
    asked = []
    real = torch.empty

    def empty(*args, **kwargs):
        asked.append(kwargs.get("pin_memory", False))
        return real(*args, **{**kwargs, "pin_memory": False})  # no pinned allocator here

    monkeypatch.setattr(device_copy.torch, "empty", empty)
    HostCopier("cpu").host_empty((4,), torch.float32)
    DeviceCopier(DEVICE).host_empty((4,), torch.float32)
    CudaCopier("cuda:0", api=FakeCuda()).host_empty((4,), torch.float32)
    assert asked == [False, False, True]


class FakeEvent:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def record(self, stream) -> None:
        self.log.append(("record", self.name, stream.name))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))


class FakeStream:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait", self.name, event.name))


class FakeCudart:
    def __init__(self, log: list, err: int) -> None:
        self.log, self.err = log, err

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.log.append(("register", ptr, nbytes, flags))
        return self.err

    def cudaHostUnregister(self, ptr: int) -> int:
        self.log.append(("unregister", ptr))
        return 0


class FakeCuda:
    """What CudaCopier uses of torch.cuda, recording the order of the calls."""

    def __init__(self, register_error: int = 0) -> None:
        self.log: list = []
        self.forward = FakeStream(self.log, "forward")
        self.current = self.forward
        self.events = 0
        self._cudart = FakeCudart(self.log, register_error)

    def Stream(self, device) -> FakeStream:  # noqa: N802 (torch.cuda's name)
        self.log.append(("new stream", str(device)))
        return FakeStream(self.log, "copy")

    def Event(self) -> FakeEvent:  # noqa: N802
        self.events += 1
        return FakeEvent(self.log, f"e{self.events}")

    def current_stream(self, device=None) -> FakeStream:
        return self.current

    def stream(self, s: FakeStream):
        api = self

        class Use:
            def __enter__(self):
                api.log.append(("enter", s.name))
                api.current, self.before = s, api.current

            def __exit__(self, *exc):
                api.log.append(("exit", s.name))
                api.current = self.before

        return Use()

    def cudart(self) -> FakeCudart:
        return self._cudart


def test_cuda_fill_host_orders_the_copy_after_the_forward_and_hashes_after_its_event():
    api = FakeCuda()
    c = CudaCopier(DEVICE, api=api)
    with fake_device():
        cache = torch.empty(8, 4, device=DEVICE)
        host = torch.empty(3, 4)
        ids = c.index([5, 0, 2])  # made on the copy stream, where the gather reads it
        assert ids.device == DEVICE

        def gather(out: torch.Tensor) -> None:
            assert out.device == DEVICE and api.current.name == "copy"
            api.log.append(("gather",))
            torch.index_select(cache, 0, ids, out=out)

        ready = c.fill_host(host, gather)
    assert api.log == [
        ("new stream", str(DEVICE)),
        ("enter", "copy"),
        ("exit", "copy"),
        ("record", "e1", "forward"),  # after the work queued so far: the layer's KV store
        ("wait", "copy", "e1"),
        ("enter", "copy"),
        ("gather",),
        ("record", "e2", "copy"),  # after the device-to-host copy
        ("exit", "copy"),
    ]
    ready.wait()
    assert api.log[-1] == ("synchronize", "e2")


def test_cuda_fill_device_makes_the_forward_wait_for_the_load():
    api = FakeCuda()
    c = CudaCopier(DEVICE, api=api)
    with fake_device():
        cache = torch.empty(8, 4, device=DEVICE)
        host = torch.empty(3, 4)
        ids = torch.tensor([5, 0, 2]).to(DEVICE)

        def scatter(src: torch.Tensor) -> None:
            assert src.device == DEVICE and api.current.name == "copy"
            cache.index_copy_(0, ids, src)

        c.fill_device(host, scatter)
    assert api.log[1:] == [
        ("record", "e1", "forward"),
        ("wait", "copy", "e1"),
        ("enter", "copy"),
        ("record", "e2", "copy"),
        ("exit", "copy"),
        ("wait", "forward", "e2"),  # the next step's forward reads the loaded blocks
    ]


@pytest.mark.parametrize("err", [0, 1])
def test_cuda_registers_host_memory_and_unregisters_only_what_it_registered(err):
    api = FakeCuda(register_error=err)
    c = CudaCopier("cuda:0", api=api)
    buf = torch.zeros(64, dtype=torch.uint8)
    assert c.register(buf) is (err == 0)
    c.register(buf)  # once per buffer
    c.unregister(buf)
    calls = [e for e in api.log if e[0] in ("register", "unregister")]
    if err == 0:
        assert calls == [("register", buf.data_ptr(), 64, 0), ("unregister", buf.data_ptr())]
    else:  # pageable then: the copies are synchronous, still correct
        assert calls == [("register", buf.data_ptr(), 64, 0)] * 2


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
def test_cuda_copies_round_trip_on_a_gpu():
    from engine.cluster.transfer.staging import StagingArena

    c = make_copier("cuda")
    cache = torch.randn(8, 4, device="cuda")
    host = c.host_empty((3, 4), torch.float32)
    assert host.is_pinned()
    ids = c.index([5, 0, 2])
    c.fill_host(host, lambda out: torch.index_select(cache, 0, ids, out=out)).wait()
    assert torch.equal(host, cache[[5, 0, 2]].cpu())
    back = torch.zeros_like(cache)
    c.fill_device(host, lambda src: back.index_copy_(0, ids, src)).wait()
    torch.cuda.synchronize()
    assert torch.equal(back[[5, 0, 2]], cache[[5, 0, 2]])
    arena = StagingArena(1 << 20, shared=True)
    try:
        assert c.register(arena.buf)
        c.unregister(arena.buf)
    finally:
        arena.close()
