"""The KV transfer path's memory: the decode worker's staging arena, its layout and checksums.

A decode worker owns one staging arena. Each request it expects gets an area of it, laid out
``[layers, 2, tokens, kv_heads, head_dim]`` in the cache's dtype, so one chunk of one layer is two
contiguous runs (its K rows, its V rows). Over shared memory (``shm``) the arena is a file in
/dev/shm that prefill workers of the same host map and write into directly: the socket then
carries only descriptors (layer, token range, checksum). Over TCP the bytes travel as raw ZeroMQ
frames and the decode worker copies them into the same arena (private memory then).

The arena is allocated first fit from a sorted free list; every area is freed by the decode
worker (loaded, aborted, failed, or past its deadline), never by the writer, so a prefill worker
that dies leaks nothing. A file left by a decode worker that was killed is removed by whoever
started it (``remove_stale_arenas``).
"""

from __future__ import annotations

import bisect
import glob
import mmap
import os
import threading
import uuid
from typing import NamedTuple

import torch
import xxhash

from engine.ipc.process_id import remove_orphan_files
from engine.ipc.shm_names import check_shm_path
from engine.kv_connector.device_copy import HostCopier

ARENA_PREFIX = "engine-kvstage-"  # the pool's arenas are engine-kv-<hex>
ALIGN = 64


class KVLayout(NamedTuple):
    """Where tokens [start, end) of one layer's K (kv=0) or V (kv=1) lie in a staging area."""

    num_layers: int
    num_tokens: int
    token_bytes: int  # kv_heads * head_dim * element size

    @property
    def nbytes(self) -> int:
        return self.num_layers * 2 * self.num_tokens * self.token_bytes

    def run(self, layer: int, kv: int, start: int, end: int) -> tuple[int, int]:
        """(offset, length) in bytes of the run, from the start of the area."""
        return ((layer * 2 + kv) * self.num_tokens + start) * self.token_bytes, (
            end - start
        ) * self.token_bytes


def checksum(*parts) -> int:
    """xxh3_64 over the parts in order (memory speed; ~10x zlib.crc32)."""
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return h.intdigest()


class StagingArena:
    """Per-request staging areas in one block of memory, shared (a /dev/shm file) or private."""

    def __init__(self, nbytes: int, shared: bool = True) -> None:
        if nbytes < ALIGN:
            raise ValueError(f"staging arena size must be >= {ALIGN} bytes, got {nbytes}")
        self.nbytes = nbytes
        self.path = ""
        if shared:
            remove_orphan_files(ARENA_PREFIX)  # a SIGKILLed worker's arena, if any
            self.path = f"/dev/shm/{ARENA_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, nbytes)  # sparse: pages are taken as areas are written
                self._mm = mmap.mmap(fd, nbytes)
            finally:
                os.close(fd)
        else:
            self._mm = mmap.mmap(-1, nbytes)
        self.buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # (offset, size), sorted by offset
        self._sizes: dict[int, int] = {}
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new area of nbytes, or None when no free run is large enough."""
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        with self._lock:
            for i, (off, free) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        del self._free[i]
                    else:
                        self._free[i] = (off + size, free - size)
                    self._sizes[off] = size
                    return off
        return None

    def free(self, offset: int) -> None:
        with self._lock:
            size = self._sizes.pop(offset, None)
            if size is None:
                return  # freed already (abort racing a load): a no-op
            i = bisect.bisect(self._free, (offset, 0))
            self._free.insert(i, (offset, size))
            # Merge with the neighbours so large areas stay available.
            if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
                self._free[i] = (offset, size + self._free.pop(i + 1)[1])
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
                prev = self._free.pop(i - 1)
                self._free[i - 1] = (prev[0], prev[1] + self._free[i - 1][1])

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.buf[offset : offset + nbytes]

    def close(self) -> None:
        self.buf = None  # drop the export before closing the map
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere; the unlink still frees it
            pass
        if self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class PeerArenas:
    """A prefill worker's maps of decode workers' arenas (same host), opened on first use.
    ``copier`` pins each map while it is open (``cudaHostRegister`` when the cache is on CUDA)."""

    def __init__(self, copier: HostCopier | None = None) -> None:
        self._maps: dict[str, tuple[mmap.mmap, torch.Tensor]] = {}
        self._copier = copier

    def get(self, path: str) -> torch.Tensor:
        if path not in self._maps:
            check_shm_path(path, ARENA_PREFIX)  # a router message names it: ours, in /dev/shm
            fd = os.open(path, os.O_RDWR)
            try:
                mm = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
            buf = torch.frombuffer(mm, dtype=torch.uint8)
            if self._copier is not None:
                self._copier.register(buf)
            self._maps[path] = (mm, buf)
        return self._maps[path][1]

    def forget(self, path: str) -> None:
        entry = self._maps.pop(path, None)
        if entry is not None:
            if self._copier is not None:
                self._copier.unregister(entry[1])
            del entry
            # the map closes when the last view is gone

    def close(self) -> None:
        for path in list(self._maps):
            self.forget(path)


def remove_stale_arenas(pids: list[int]) -> int:
    """Remove the arena files of the given (dead) processes; returns how many."""
    n = 0
    for pid in pids:
        for path in glob.glob(f"/dev/shm/{ARENA_PREFIX}{pid}-*"):
            try:
                os.unlink(path)
                n += 1
            except FileNotFoundError:
                pass
    return n


def _runs(table: list[int] | torch.Tensor, start: int, end: int, bs: int):
    """Split tokens [start, end) into (kind, a, b): "blocks" for whole blocks, "tokens" for the
    partial blocks at either end."""
    first_full = -(-start // bs) * bs
    last_full = (end // bs) * bs
    if first_full >= last_full:
        return [("tokens", start, end)]
    out = []
    if start < first_full:
        out.append(("tokens", start, first_full))
    out.append(("blocks", first_full, last_full))
    if last_full < end:
        out.append(("tokens", last_full, end))
    return out


def _slots(table: torch.Tensor, a: int, b: int, bs: int) -> torch.Tensor:
    """The cache slots of tokens [a, b), on the table's device (the cache's)."""
    tok = torch.arange(a, b, device=table.device)
    return table[tok // bs] * bs + tok % bs


def gather_tokens(src: torch.Tensor, table: torch.Tensor, start: int, end: int, out) -> None:
    """out[t - start] = KV of token t, for t in [start, end). src: one layer's K or V,
    [blocks, block_size, heads, dim]; table: the request's block ids (long, on src's device);
    out: [end - start, heads, dim]. Whole blocks are copied as blocks (12 KiB rows for the
    default model), not token by token."""
    bs = src.shape[1]
    flat = src.view(-1, *src.shape[2:])
    for kind, a, b in _runs(table, start, end, bs):
        dst = out[a - start : b - start]
        if kind == "blocks":
            ids = table[a // bs : b // bs]
            torch.index_select(src, 0, ids, out=dst.view(-1, bs, *src.shape[2:]))
        else:
            torch.index_select(flat, 0, _slots(table, a, b, bs), out=dst)


def scatter_tokens(staged: torch.Tensor, dst: torch.Tensor, table: torch.Tensor, start: int):
    """The inverse for every layer at once: dst [layers, 2, blocks, block_size, heads, dim] gets
    staged [layers, 2, n, heads, dim] as tokens [start, start + n) of the request."""
    bs = dst.shape[3]
    n = staged.shape[2]
    flat = dst.view(*dst.shape[:2], -1, *dst.shape[4:])
    for kind, a, b in _runs(table, start, start + n, bs):
        part = staged[:, :, a - start : b - start]
        if kind == "blocks":
            ids = table[a // bs : b // bs]
            dst.index_copy_(2, ids, part.reshape(*dst.shape[:2], -1, bs, *dst.shape[4:]))
        else:
            flat.index_copy_(2, _slots(table, a, b, bs), part)
