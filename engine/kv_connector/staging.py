"""Host staging buffers kept from one KV load for the next.

A fresh host buffer's pages are faulted in, and zeroed by the kernel, as a load first writes
them: about 0.4 ms per MB on the 2-core machines, three quarters of loading an 8k-token bf16
prefix from the DRAM tier (74 of 104 ms; a buffer written before takes the same bytes at memcpy
speed), and the part of a load that an int8 cache's half-size blocks saved least on. Pinned
buffers (CUDA) cost more still to allocate. So the pool's loader takes its staging buffer from
here and the engine thread gives it back once the scatter is done with it (with the copier's
``Ready``: on CUDA the copy to the device may still be reading it).

Bounded: at most ``keep_bytes`` are kept (the largest load's buffer, by default one 8k-token
bf16 prefix of the default model fits with room); a buffer given back beyond that is dropped.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from engine.kv_connector.device_copy import DONE, HostCopier, Ready

KEEP_BYTES = 512 << 20


class StagingCache:
    def __init__(self, copier: HostCopier, keep_bytes: int = KEEP_BYTES) -> None:
        self.copier = copier
        self.keep_bytes = keep_bytes
        self._free: list[tuple[torch.Tensor, Ready]] = []  # (uint8 buffer, when it is free)
        self._lock = threading.Lock()
        self.reused = 0  # takes served by a kept buffer
        self.allocated = 0  # takes that allocated

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of ``shape`` and ``dtype`` (contents undefined): a view of the smallest
        kept buffer that holds it, or a new one."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            fits = [i for i, (b, _) in enumerate(self._free) if b.numel() >= nbytes]
            pick = min(fits, key=lambda i: self._free[i][0].numel()) if fits else None
            buf, ready = self._free.pop(pick) if pick is not None else (None, DONE)
        if buf is None:
            self.allocated += 1
            buf = self.copier.host_empty((max(nbytes, 1),), torch.uint8)
        else:
            self.reused += 1
            ready.wait()
        return buf[:nbytes].view(dtype).view(tuple(shape))

    def give(self, tensor: torch.Tensor | None, ready: Ready = DONE) -> None:
        """Keep the buffer under ``tensor`` (a tensor ``take`` returned, or a view of one) for a
        later take, once ``ready`` says the last copy from it is done."""
        if tensor is None:
            return
        base = tensor._base if tensor._base is not None else tensor
        buf = base.view(torch.uint8).view(-1) if base.dtype != torch.uint8 else base.view(-1)
        with self._lock:
            if any(b.data_ptr() == buf.data_ptr() for b, _ in self._free):
                return
            self._free.append((buf, ready))
            while sum(b.numel() for b, _ in self._free) > self.keep_bytes:
                self._free.pop(0)  # the oldest goes first

    def kept_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b, _ in self._free)
