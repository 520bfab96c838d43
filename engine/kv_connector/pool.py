"""The tiered KV pool behind the KV-connector seam.

Loads: ``lookup`` asks the store how many of a request's next blocks it holds (by chained hash);
``start_load`` queues a job for the loader thread, which reads the blocks (DRAM arena, SSD records
or a pool service) into a staging tensor; ``finished_loads`` (engine thread, between steps)
scatters the staging tensor into the request's cache blocks and keeps it for a later load
(``staging.py``: a fresh buffer's page faults were most of a load's time). A miss or bad record
part way stops the load there: the request recomputes the rest. An aborted request's job is
dropped, and since only the engine thread writes the cache, its blocks can be reused at once.

Saves: after a step, the newly full blocks are gathered (engine thread, one copy) into a staging
tensor and queued for the writer thread, which puts them in the store. The step loop never waits
on a disk or a socket: when more than ``max_write_bytes`` are queued, further saves are dropped
and counted.

Staging layout: [n, layers, 2, block_size, kv_heads, head_dim], so each block's KV for every
layer is one contiguous record of ``block_bytes``. Staging tensors are host memory; the copier
(``device_copy.py``, chosen by the cache's device) moves them: on the CPU the gather writes the
staging tensor and the scatter reads it directly; on CUDA they are pinned, a batch's copy runs on
the copy stream with an event (the writer thread waits for a save's before reading it; the
forward's stream waits for a load's before the next step reads the blocks).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.kernels import kv_gather, kv_scatter
from engine.kv_connector.base import KVConnector, LoadDone
from engine.kv_connector.device_copy import DONE, HostCopier, Ready, make_copier
from engine.kv_connector.staging import StagingCache

log = logging.getLogger(__name__)

_STOP = object()
_LOAD_WINDOW = 16  # blocks read per store call; cancellation is checked between windows


@dataclass
class _LoadJob:
    request_id: str
    keys: list[bytes]
    block_ids: list[int]
    cancelled: bool = False
    # Filled by the loader thread.
    staging: torch.Tensor | None = None
    loaded: int = 0
    sources: dict[str, int] = field(default_factory=dict)
    error: str | None = None


class PoolConnector(KVConnector):
    def __init__(
        self,
        store,
        kv_cache: torch.Tensor,
        block_size: int,
        max_loads: int = 256,
        max_write_bytes: int = 256 << 20,
        known_keys: int = 1 << 16,
        copier: HostCopier | None = None,
    ) -> None:
        """store: a BlockStore (engine/kvstore/block_store.py); kv_cache: the paged cache tensor
        [layers, 2, num_blocks, block_size, kv_heads, head_dim]; copier: how blocks reach host
        memory (default: the one for the cache's device)."""
        self.store = store
        self.kv = kv_cache
        self.copier = make_copier(kv_cache.device) if copier is None else copier
        self.block_size = block_size
        layers, two, _, bs, heads, dim = kv_cache.shape
        self.block_shape = (layers, two, bs, heads, dim)
        self.block_bytes = kv_cache[:, :, 0].numel() * kv_cache.element_size()
        self.max_write_bytes = max_write_bytes
        self._staging = StagingCache(self.copier)  # loads' host buffers, kept for the next
        self._active: dict[str, _LoadJob] = {}
        self._hashes: dict[str, Sequence[bytes]] = {}  # from lookup, for start_load
        self._loads: queue.Queue = queue.Queue(maxsize=max_loads)
        self._writes: queue.Queue = queue.Queue()  # bounded in bytes by _write_bytes
        self._write_bytes = 0
        self._done: list[_LoadJob] = []
        self._cv = threading.Condition()
        # Keys the store is known to hold (loaded or saved lately): not gathered and put again.
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._known_cap = known_keys
        self._known_lock = threading.Lock()  # the writer forgets keys whose put failed
        self.counters = {
            "loads": 0,
            "loaded_blocks": 0,
            "failed_loads": 0,
            "saved_blocks": 0,
            "failed_writes": 0,
            "dropped_writes": 0,
        }
        self._closed = False
        self._threads = [
            threading.Thread(target=self._load_loop, name="kv-pool-loader", daemon=True),
            threading.Thread(target=self._write_loop, name="kv-pool-writer", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # -- loads (engine thread) --------------------------------------------------------------

    def lookup(self, req, block_hashes: Sequence[bytes], num_device_tokens: int) -> int:
        bs = self.block_size
        first = num_device_tokens // bs
        last = (req.num_tokens - 1) // bs  # leave the last token to compute
        keys = list(block_hashes[first:last])
        self._hashes[req.request_id] = block_hashes  # start_load follows when blocks are free
        if not keys:
            return 0
        try:
            n = self.store.match(keys)
        except Exception as exc:  # a store must not raise, but never let it fail a request
            log.warning("KV pool lookup failed: %s", exc)
            n = 0
        self._forget(keys[n:])  # the pool lost them (evicted, restarted): save them again
        return n * bs

    def start_load(self, req, block_table, start_token: int, num_tokens: int) -> None:
        bs = self.block_size
        first, n = start_token // bs, num_tokens // bs
        hashes = self._hashes.pop(req.request_id)
        job = _LoadJob(req.request_id, hashes[first : first + n], list(block_table[first:][:n]))
        self._active[req.request_id] = job
        self.counters["loads"] += 1
        try:
            self._loads.put_nowait(job)
        except queue.Full:
            job.error = "the KV pool's load queue is full"
            with self._cv:
                self._done.append(job)

    def finished_loads(self) -> list[LoadDone]:
        with self._cv:
            done, self._done = self._done, []
        out = []
        for job in done:
            if job.cancelled or self._active.get(job.request_id) is not job:
                self._staging.give(job.staging)
                continue
            del self._active[job.request_id]
            ready = DONE
            if job.loaded:
                ready = self._scatter(job.staging[: job.loaded], job.block_ids[: job.loaded])
                self._remember(job.keys[: job.loaded])
            self._staging.give(job.staging, ready)
            job.staging = None
            self.counters["loaded_blocks"] += job.loaded
            if job.error is not None:
                self.counters["failed_loads"] += 1
            out.append(
                LoadDone(job.request_id, job.loaded * self.block_size, job.sources, job.error)
            )
        return out

    def _scatter(self, staging: torch.Tensor, block_ids: Sequence[int]) -> Ready:
        """Loaded blocks (host staging [n, layers, 2, ...]) into cache blocks block_ids; when
        the staging tensor may be written again (on CUDA the copy may still read it)."""
        ids = self.copier.index(block_ids)
        return self.copier.fill_device(
            staging, lambda src: kv_scatter(src.permute(1, 2, 0, 3, 4, 5), ids, self.kv)
        )

    def _gather(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, Ready]:
        """Cache blocks block_ids into a new host staging tensor [n, layers, 2, ...], and when
        its bytes are there."""
        ids = self.copier.index(block_ids)
        staging = self.copier.host_empty((len(block_ids), *self.block_shape), self.kv.dtype)
        ready = self.copier.fill_host(
            staging, lambda out: kv_gather(self.kv, ids, out.permute(1, 2, 0, 3, 4, 5))
        )
        return staging, ready

    def wait(self, timeout: float) -> None:
        with self._cv:
            if not self._done:
                self._cv.wait(timeout)

    def request_finished(self, req) -> None:
        self._hashes.pop(req.request_id, None)
        job = self._active.pop(req.request_id, None)
        if job is not None:
            job.cancelled = True  # the loader skips it; finished_loads drops its result

    # -- saves (engine thread) --------------------------------------------------------------

    def save(self, req, block_table, block_hashes, first_block: int, num_blocks: int) -> None:
        picked = [
            (first_block + j, block_hashes[first_block + j], block_table[first_block + j])
            for j in range(num_blocks)
        ]
        with self._known_lock:
            picked = [p for p in picked if p[1] not in self._known]
        if not picked:
            return
        nbytes = len(picked) * self.block_bytes
        with self._cv:
            if self._closed or self._write_bytes + nbytes > self.max_write_bytes:
                self.counters["dropped_writes"] += len(picked)
                return
            self._write_bytes += nbytes
        staging, ready = self._gather([b for _, _, b in picked])
        keys = [h for _, h, _ in picked]
        self._remember(keys)
        self._writes.put((keys, [p for p, _, _ in picked], staging, ready, nbytes))

    def _remember(self, keys: Sequence[bytes]) -> None:
        with self._known_lock:
            for k in keys:
                self._known[k] = None
                self._known.move_to_end(k)
            while len(self._known) > self._known_cap:
                self._known.popitem(last=False)

    def _forget(self, keys: Sequence[bytes]) -> None:
        with self._known_lock:
            for k in keys:
                self._known.pop(k, None)

    # -- the IO threads ---------------------------------------------------------------------

    def _load_loop(self) -> None:
        while True:
            job = self._loads.get()
            if job is _STOP:
                return
            if not job.cancelled:
                self._load(job)
            with self._cv:
                self._done.append(job)
                self._cv.notify_all()

    def _load(self, job: _LoadJob) -> None:
        n = len(job.keys)
        job.staging = self._staging.take((n, *self.block_shape), self.kv.dtype)
        rows = job.staging.view(torch.uint8).numpy().reshape(n, -1)
        get_many = getattr(self.store, "get_many", None)  # reads SSD records ahead
        for start in range(0, n, _LOAD_WINDOW):
            if job.cancelled:
                return
            keys = job.keys[start : start + _LOAD_WINDOW]
            outs = [memoryview(rows[j]) for j in range(start, start + len(keys))]
            try:
                if get_many is not None:
                    served = get_many(keys, outs)
                else:
                    served = [self.store.get_into(k, o) for k, o in zip(keys, outs)]
            except Exception as exc:  # a store must not raise; recompute if it does
                served, job.error = [], f"read failed: {exc}"
            for tier in served:
                if tier is None:
                    break
                job.loaded += 1
                job.sources[tier] = job.sources.get(tier, 0) + self.block_size
            if job.loaded < start + len(keys):
                job.error = job.error or f"block {job.loaded + 1} of {n} was not readable"
                return

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            if item is _STOP:
                return
            keys, positions, staging, ready, nbytes = item
            ready.wait()  # the batch's device-to-host copy
            stored = self._put(keys, positions, staging)
            self.counters["saved_blocks"] += sum(stored)
            self.counters["failed_writes"] += len(keys) - sum(stored)
            self._forget([k for k, ok in zip(keys, stored) if not ok])
            with self._cv:
                self._write_bytes -= nbytes
                self._cv.notify_all()

    def _put(self, keys, positions, staging) -> list[bool]:
        try:
            rows = staging.view(torch.uint8).numpy().reshape(len(keys), -1)  # host memory
            datas = [memoryview(row) for row in rows]
            put_many = getattr(self.store, "put_many", None)  # batches for a remote tier
            if put_many is not None:
                return list(put_many(keys, datas, positions))
            return [self.store.put(k, d, p) for k, d, p in zip(keys, datas, positions)]
        except Exception as exc:  # a store must not raise; never kill the writer
            log.warning("KV pool write failed: %s", exc)
            return [False] * len(keys)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued save reached the store (tests, benchmarks, shutdown)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._write_bytes == 0, timeout)

    # -- the rest ---------------------------------------------------------------------------

    def stats(self) -> dict:
        return {**self.counters, "tiers": self.store.stats()}

    def close(self) -> None:
        with self._cv:
            if self._closed:
                return
            self._closed = True
        self.flush(timeout=10.0)
        for q in (self._loads, self._writes):
            try:
                q.put(_STOP, timeout=1.0)
            except queue.Full:
                pass
        for t in self._threads:
            t.join(timeout=5.0)
        self.store.close()
