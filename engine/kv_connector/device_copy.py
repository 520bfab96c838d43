"""Copies between the KV cache's device and host memory, chosen once by the cache's device.

Every path that moves KV between the paged cache and a host buffer (the P/D sender's layers, the
receiver's staged KV, the pool's loads and saves) goes through one ``HostCopier``:

- ``HostCopier``: the cache is in host memory (CPU). Device-side work writes straight into the
  host buffer (the sender gathers into the decode worker's mapped staging area: zero copy),
  nothing is pinned and nothing waits. This is the CPU path as it always was.
- ``DeviceCopier``: a cache on another device, copied synchronously: device-side work writes
  into a device staging tensor, then one explicit device-to-host copy (or host-to-device).
- ``CudaCopier``: the same on a copy stream with events, so copies overlap the forward. Host
  buffers are pinned (and mapped staging areas registered with ``cudaHostRegister``) so the
  copies are DMA that does not block the host. Before its copies the copy stream waits for an
  event recorded on the forward's stream (the layer's KV store is queued before it); after
  them it records an event: ``Ready.wait`` synchronizes it (a sender thread then hashes the
  bytes, off the forward's stream), and loads make the forward's stream wait for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)


class Ready(Protocol):
    """A copy into host memory under way: ``wait`` returns once its bytes are there."""

    def wait(self) -> None: ...


class _Done:
    def wait(self) -> None:
        pass


DONE: Ready = _Done()


class _EventReady:
    def __init__(self, event: Any) -> None:
        self.event = event

    def wait(self) -> None:
        self.event.synchronize()


class HostCopier:
    """The cache is in host memory: device-side work runs on the host buffers themselves."""

    on_host = True  # device-side work writes host buffers directly; their bytes are ready at once
    pinned = False

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    def host_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A host buffer copies to and from the device go through (pinned on CUDA)."""
        return torch.empty(tuple(shape), dtype=dtype, device="cpu", pin_memory=self.pinned)

    def register(self, buf: torch.Tensor) -> bool:
        """Pin host memory that was not allocated pinned (a mapped staging area); False when it
        is not pinned (nothing to do here, or the driver refused)."""
        return False

    def unregister(self, buf: torch.Tensor) -> None:
        pass

    def index(self, values: Sequence[int]) -> torch.Tensor:
        """An index tensor (long) on the device, for device-side work of this copier. Made on
        the host and moved, as ``torch.tensor(..., device=)`` does inside, but through the
        dispatcher, so a fake device in the tests sees it."""
        return torch.tensor(list(values), dtype=torch.long).to(self.device)

    def fill_host(self, dst: torch.Tensor, produce: Callable[[torch.Tensor], None]) -> Ready:
        """``dst`` (host memory) gets what ``produce`` writes into a tensor of its shape and
        dtype on the device. Here ``produce`` writes ``dst`` itself."""
        produce(dst)
        return DONE

    def fill_device(self, src: torch.Tensor, consume: Callable[[torch.Tensor], None]) -> Ready:
        """``consume`` gets ``src`` (host memory) on the device; the forward's later work sees
        what it wrote. The Ready says when ``src`` may be written again."""
        consume(src)
        return DONE


class DeviceCopier(HostCopier):
    """A cache on a device, copied synchronously through a device staging tensor."""

    on_host = False

    def fill_host(self, dst: torch.Tensor, produce: Callable[[torch.Tensor], None]) -> Ready:
        staging = torch.empty(dst.shape, dtype=dst.dtype, device=self.device)
        produce(staging)
        dst.copy_(staging)
        return DONE

    def fill_device(self, src: torch.Tensor, consume: Callable[[torch.Tensor], None]) -> Ready:
        consume(src.to(self.device))
        return DONE


class CudaCopier(DeviceCopier):
    """Copies on a copy stream, ordered against the forward's stream by events; pinned host
    buffers. ``api`` is ``torch.cuda`` (a stand-in in the tests); the stream is made on first
    use, so choosing this copier needs no GPU."""

    pinned = True

    def __init__(self, device: torch.device | str, api: Any = None) -> None:
        super().__init__(device)
        self.api = torch.cuda if api is None else api
        self._copy_stream: Any = None
        self._registered: dict[int, int] = {}  # data_ptr -> bytes, for cudaHostUnregister

    def stream(self) -> Any:
        if self._copy_stream is None:
            self._copy_stream = self.api.Stream(device=self.device)
        return self._copy_stream

    def register(self, buf: torch.Tensor) -> bool:
        ptr, nbytes = buf.data_ptr(), buf.numel() * buf.element_size()
        if ptr in self._registered:
            return True
        cudart = self.api.cudart()
        err = cudart.cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:  # pageable then: the copies are synchronous, still correct
            log.warning(
                "cudaHostRegister of %d bytes failed (%s); copies will not overlap", nbytes, err
            )
            return False
        self._registered[ptr] = nbytes
        return True

    def unregister(self, buf: torch.Tensor) -> None:
        if self._registered.pop(buf.data_ptr(), None) is not None:
            self.api.cudart().cudaHostUnregister(buf.data_ptr())

    def index(self, values: Sequence[int]) -> torch.Tensor:
        """Through pinned memory, without a wait: a blocking host-to-device copy synchronizes
        its stream, which would hold the engine thread until the earlier layers' copies ended.
        Made on the copy stream, where it is used (and its memory reused only after that)."""
        host = self.host_empty((len(values),), torch.long)
        host.copy_(torch.tensor(list(values), dtype=torch.long))
        with self.api.stream(self.stream()):
            return host.to(self.device, non_blocking=True)

    def _after_forward(self) -> Any:
        """The copy stream waits for the work queued so far on the forward's stream."""
        stream = self.stream()
        forward = self.api.Event()
        forward.record(self.api.current_stream(self.device))
        stream.wait_event(forward)
        return stream

    def fill_host(self, dst: torch.Tensor, produce: Callable[[torch.Tensor], None]) -> Ready:
        stream = self._after_forward()
        with self.api.stream(stream):
            staging = torch.empty(dst.shape, dtype=dst.dtype, device=self.device)
            produce(staging)
            dst.copy_(staging, non_blocking=True)
            done = self.api.Event()
            done.record(stream)
        return _EventReady(done)

    def fill_device(self, src: torch.Tensor, consume: Callable[[torch.Tensor], None]) -> Ready:
        stream = self._after_forward()  # the blocks written may still be read by queued work
        with self.api.stream(stream):
            consume(src.to(self.device, non_blocking=True))
            done = self.api.Event()
            done.record(stream)
        self.api.current_stream(self.device).wait_event(done)  # the next forward reads them
        return _EventReady(done)


def make_copier(device: torch.device | str) -> HostCopier:
    """The copier for a cache on ``device``: plain host copies on the CPU."""
    device = torch.device(device)
    if device.type == "cpu":
        return HostCopier(device)
    if device.type == "cuda":
        return CudaCopier(device)
    return DeviceCopier(device)
