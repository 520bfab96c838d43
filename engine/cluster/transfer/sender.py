"""The prefill worker's side of the KV transfer: layer-wise streaming through the connector seam.

``per_layer`` is set, so the engine calls ``save_layer(i, step)`` from the model's layer hook
right after layer i wrote this step's KV. For every request being sent, the layer's new prompt
tokens (and, on the first chunk, any prefix the prefill worker found cached) leave at once:

- ``shm``: gathered from the paged cache straight into the decode worker's staging area (a
  mapped /dev/shm file) and hashed while the bytes are in the CPU cache; the sender thread
  sends a descriptor.
- ``tcp``: gathered into a reused buffer and hashed the same way; the sender thread sends it
  as two raw ZeroMQ frames (K rows, V rows) without a copy, and ZeroMQ's IO thread writes them
  while layer i+1 computes.

A cache on a GPU goes through its copier (``kv_connector/device_copy.py``): the layer is gathered
on a copy stream once the forward's stream has queued its KV store, copied into the (registered)
staging area or a pinned buffer, and the sender thread waits for that copy's event and hashes the
bytes, so neither the forward's stream nor the engine thread waits for the copy.

Either way layer i is on its way while layer i+1 computes. ``finish`` queues ``KVDone`` (the
first tokens and the sampler state) behind the request's last layer on the same socket, so the
decode worker sees it after every layer. Sends never block the step loop: a decode worker that
stops reading makes sends fail at their deadline (its own deadline then applies the failure
policy). Loads and block saves go to ``inner`` (the KV pool), when there is one.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import zmq

from engine.cluster import messages as m
from engine.cluster.transfer import faults
from engine.cluster.transfer.seal import seal
from engine.cluster.transfer.staging import KVLayout, PeerArenas, checksum, gather_tokens
from engine.ipc import curve
from engine.ipc.liveness import DATA_TIMEOUT_MS, watch_peer
from engine.kv_connector.base import KVConnector, LoadDone, StepBlocks, WrapsPool
from engine.kv_connector.device_copy import HostCopier, Ready, make_copier

log = logging.getLogger(__name__)

SEND_HWM = 64  # messages queued per decode worker in ZeroMQ before sends wait
POOL_BYTES = 256 << 20  # TCP send buffers kept for reuse (fresh ones cost page faults)


@dataclass
class SendTarget:
    request_id: str
    follow: str  # the engine request whose KV is sent (the first choice when n > 1)
    kv_address: str
    transport: str  # "shm" | "tcp"
    shm_path: str
    offset: int
    layout: KVLayout
    stream_layers: bool = True
    peer_address: str = ""  # mooncake: the decode worker's Transfer Engine and arena base
    peer_base: int = 0
    prompt_digest: bytes = b""  # seal.prompt_digest of the prompt: KVDone's seal covers it
    sent: list[int] = field(default_factory=list)  # per layer: tokens sent so far
    # (layer, start, end, checksum) of every piece sent (the sender thread's): the seal's
    pieces: list[tuple[int, int, int, int]] = field(default_factory=list)
    failed: bool = False
    last_layer_time: float = 0.0  # monotonic time the last layer of the last chunk left


class _Done:
    done = True  # a buffer copied out already (Mooncake's bounce buffer)


_DONE = _Done()


class KVSender(WrapsPool):
    per_layer = True

    def __init__(
        self,
        kv_cache: torch.Tensor,
        block_size: int,
        inner: KVConnector | None = None,
        send_timeout: float = 30.0,
        max_queue: int = 1024,
        mooncake=None,
        copier: HostCopier | None = None,
        layers: range | None = None,
        model_layers: int | None = None,
    ) -> None:
        """copier: how KV reaches host memory (default: the one for the cache's device).
        ``layers``: the model's layers this cache holds, by global index (a pipeline stage's
        range; default: all of kv_cache's), of ``model_layers`` in the whole model (the decode
        worker's staging layout; default: as many as the cache holds). KVLayer messages and
        ``save_layer`` calls name layers by global index."""
        self.kv = kv_cache  # [layers, 2, blocks, block_size, kv_heads, head_dim]
        self.copier = make_copier(kv_cache.device) if copier is None else copier
        self.block_size = block_size
        self.inner = inner
        self.mooncake = mooncake  # a MooncakeEndpoint, for --kv-transport mooncake
        self.send_timeout = send_timeout
        held, _, blocks, bs, heads, dim = kv_cache.shape
        self.layers = range(held) if layers is None else layers
        if len(self.layers) != held:
            raise ValueError(f"layers {self.layers} do not match the cache's {held} layers")
        self.num_layers = model_layers or self.layers.stop  # the whole model's
        if self.layers.stop > self.num_layers:
            raise ValueError(f"layers {self.layers} exceed the model's {self.num_layers}")
        self.token_bytes = heads * dim * kv_cache.element_size()
        self._targets: dict[str, SendTarget] = {}  # by request id
        self._following: dict[str, SendTarget] = {}  # by followed engine request id
        self._peers = PeerArenas(self.copier)
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        # TCP send buffers: reused once ZeroMQ is done with them (its tracker says so).
        self._returns: deque = deque()  # (tracker, buffer), appended by the sender thread
        self._pool: dict[int, list[torch.Tensor]] = {}
        self._pool_bytes = 0
        self.counters = {"layers_sent": 0, "bytes_sent": 0, "failed_transfers": 0}
        self.faults = faults.from_env()  # chaos tests only (ENGINE_FAULT_KV)
        self._thread = threading.Thread(target=self._send_loop, name="kv-sender", daemon=True)
        self._thread.start()

    # -- the worker's calls (engine thread) ----------------------------------------------------

    def add(self, target: SendTarget) -> None:
        target.sent = [0] * self.num_layers
        self._targets[target.request_id] = target
        self._following[target.follow] = target

    def finish(self, request_id: str, done: m.KVDone) -> float | None:
        """Every choice has its first token: send what is left and then ``done``. Returns the
        time the last layer left the step loop (for the exposed-transfer measurement)."""
        t = self._targets.pop(request_id, None)
        if t is None:
            return None
        self._following.pop(t.follow, None)
        if not t.stream_layers:  # streaming off: every layer now (benchmarks)
            t.stream_layers = True
            self._send_all_layers(t, t.pending_table)  # type: ignore[attr-defined]
        self._put(t, ("done", t, done))  # sealed by the sender thread, after every layer
        return t.last_layer_time

    def cancel(self, request_id: str, reason: str) -> None:
        t = self._targets.pop(request_id, None)
        if t is not None:
            self._following.pop(t.follow, None)
            abort = m.KVAbort(request_id, reason, layer_start=self.layers.start)
            self._put(t, ("msg", t, m.encode(abort)))

    @property
    def num_transfers(self) -> int:
        return len(self._targets)

    # -- the seam ---------------------------------------------------------------------------

    def save_layer(self, layer: int, step: Sequence[StepBlocks]) -> None:
        if self.inner is not None and self.inner.per_layer:
            self.inner.save_layer(layer, step)
        for s in step:
            t = self._following.get(s.request.request_id)
            if t is None or t.failed:
                continue
            upto = min(s.request.num_computed_tokens + len(s.slots), t.layout.num_tokens)
            if not t.stream_layers:
                t.pending_table = s.block_table  # type: ignore[attr-defined]
                continue
            if layer == self.layers[-1] and upto == t.layout.num_tokens:
                t.last_layer_time = time.monotonic()  # the prefill's last layer just ended
            self._send_range(t, layer, s.block_table, upto)

    def _send_all_layers(self, t: SendTarget, table: Sequence[int]) -> None:
        for layer in self.layers:
            self._send_range(t, layer, table, t.layout.num_tokens)
        t.last_layer_time = time.monotonic()

    @torch.inference_mode()  # as in the forward: pooled buffers are inference tensors
    def _send_range(self, t: SendTarget, layer: int, table: Sequence[int], upto: int) -> None:
        start = t.sent[layer]
        if upto <= start:
            return
        table_t = self.copier.index(table)
        layer_kv = self.kv[layer - self.layers.start]  # [2, blocks, block_size, heads, dim]

        def gather(kv: int) -> Callable[[torch.Tensor], None]:
            return lambda out: gather_tokens(layer_kv[kv], table_t, start, upto, out)

        def gather_both(out: torch.Tensor) -> None:  # out [2, n, heads, dim]: K rows, V rows
            for kv in (0, 1):
                gather_tokens(layer_kv[kv], table_t, start, upto, out[kv])

        n = upto - start
        row = layer_kv.shape[3:]
        if t.transport == "shm":
            try:
                arena = self._peers.get(t.shm_path)
            except (OSError, ValueError) as exc:
                self._fail(t, f"cannot map the decode worker's staging area: {exc}", tell=True)
                return
            if not 0 <= t.offset <= arena.numel() - t.layout.nbytes:  # a message says where
                self._fail(
                    t,
                    f"staging area [{t.offset}, +{t.layout.nbytes}) is outside the arena",
                    tell=True,
                )
                return
            views = []
            for kv in (0, 1):
                off, length = t.layout.run(layer, kv, start, upto)
                dst = arena[t.offset + off : t.offset + off + length].view(self.kv.dtype)
                dst = dst.view(n, *row)
                ready = self.copier.fill_host(dst, gather(kv))  # in order: the last covers both
                views.append(dst)
        else:
            views = [self._buffer((2, n, *row))]
            ready = self.copier.fill_host(views[0], gather_both)
        crc = self._hot_hash(views) if self.copier.on_host else None  # else the sender thread's
        t.sent[layer] = upto
        self._put(t, ("layer", t, layer, start, upto, views, crc, ready))

    @staticmethod
    def _hot_hash(bufs) -> int:
        """The layer's checksum, taken right after the gather wrote it: the bytes are still in
        the CPU cache (hashing them later on the sender thread reads them from memory again)."""
        return checksum(*(b.reshape(-1).view(torch.uint8).numpy() for b in bufs))  # bf16 too

    def _buffer(self, shape: tuple[int, ...]) -> torch.Tensor:
        while self._returns and self._returns[0][0].done:
            _, buf = self._returns.popleft()
            nbytes = buf.numel() * buf.element_size()
            if self._pool_bytes + nbytes <= POOL_BYTES:
                self._pool.setdefault(buf.numel(), []).append(buf)
                self._pool_bytes += nbytes
        numel = 1
        for d in shape:
            numel *= d
        free = self._pool.get(numel)
        if free:
            buf = free.pop()
            self._pool_bytes -= buf.numel() * buf.element_size()
            return buf.view(shape)
        return self.copier.host_empty(shape, self.kv.dtype)  # pinned for a GPU's copies

    def _put(self, t: SendTarget, item) -> None:
        try:
            self._queue.put(item, timeout=self.send_timeout)
        except queue.Full:
            self._fail(t, "the KV send queue stayed full")

    def _fail(self, t: SendTarget, reason: str, tell: bool = False) -> None:
        """The transfer sends nothing more. ``tell``: its socket still works (the staging area
        could not be mapped, a Mooncake write failed), so a KVAbort tells the decode worker at
        once, which then recomputes or fails the request by its policy instead of waiting out
        the transfer's deadline. Best effort: not when the send queue is full."""
        if t.failed:
            return
        t.failed = True
        self.counters["failed_transfers"] += 1
        log.warning("KV transfer of %s failed: %s", t.request_id, reason)
        if tell:
            why = f"send failed: {reason}"
            abort = m.encode(m.KVAbort(t.request_id, why, layer_start=self.layers.start))
            try:
                self._queue.put_nowait(("abort", t, abort))
            except queue.Full:
                pass

    def lookup(self, req, block_hashes, num_device_tokens: int) -> int:
        return self.inner.lookup(req, block_hashes, num_device_tokens) if self.inner else 0

    def start_load(self, req, block_table, start_token: int, num_tokens: int) -> None:
        assert self.inner is not None
        self.inner.start_load(req, block_table, start_token, num_tokens)

    def finished_loads(self) -> list[LoadDone]:
        return self.inner.finished_loads() if self.inner else []

    def request_finished(self, req) -> None:
        if self.inner is not None:
            self.inner.request_finished(req)

    def close(self) -> None:
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            pass
        self._thread.join(timeout=5.0)
        self._peers.close()
        if self.inner is not None:
            self.inner.close()

    # -- the sender thread ------------------------------------------------------------------

    def _send_loop(self) -> None:
        ctx = zmq.Context.instance()
        socks: dict[str, zmq.Socket] = {}
        # Addresses whose last send waited out send_timeout (the decode worker gone silent: a
        # partition, a hung process): until one send there goes through, each send there is
        # tried once, not waited for, so the transfers queued behind, to it and to every
        # other decode worker, are not held send_timeout each.
        stuck: set[str] = set()
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    return
                t = item[1]
                if t.failed and item[0] != "abort":
                    continue
                if item[0] == "layer":
                    _, t, layer, start, end, bufs, crc, ready = item
                    if crc is None:  # a device's copy: hashed once its bytes are here
                        crc = self._hash_when_ready(bufs, ready)
                    parts = [b.reshape(-1).view(torch.uint8).numpy() for b in bufs]
                    header = m.KVLayer(t.request_id, layer, start, end, crc, t.transport == "tcp")
                    if self.faults is not None and (header := self.faults.layer(header)) is None:
                        continue
                    if t.transport == "mooncake" and not self._write_remote(t, header, bufs[0]):
                        self._fail(t, f"Mooncake write to {t.peer_address} failed", tell=True)
                        continue
                    t.pieces.append((layer, start, end, header.checksum))
                    frames = m.encode(header)
                    if header.inline:  # K rows, V rows: the receiver reads each into place
                        half = parts[0].nbytes // 2
                        frames += [parts[0][:half], parts[0][half:]]
                    nbytes = sum(p.nbytes for p in parts)
                elif item[0] == "done":
                    done = item[2]
                    sealed = seal(t.request_id, t.prompt_digest, t.pieces, done.firsts)
                    frames, nbytes = m.encode(dataclasses.replace(done, seal=sealed)), 0
                else:
                    frames, nbytes = item[2], 0
                sock = socks.get(t.kv_address)
                if sock is None:
                    sock = ctx.socket(zmq.PUSH)
                    sock.setsockopt(zmq.SNDHWM, SEND_HWM)
                    sock.setsockopt(zmq.LINGER, 0)
                    watch_peer(sock, DATA_TIMEOUT_MS)  # reconnects after a partition
                    curve.secure_client(sock)
                    try:
                        sock.connect(t.kv_address)
                    except zmq.ZMQError as exc:  # a bad address fails its transfer only
                        sock.close(linger=0)
                        self._fail(t, f"cannot connect to {t.kv_address!r}: {exc}")
                        continue
                    socks[t.kv_address] = sock
                tracker = self._send(sock, frames, 0.0 if t.kv_address in stuck else None)
                if tracker is None:
                    stuck.add(t.kv_address)
                    self._fail(t, f"{t.kv_address} took nothing for {self.send_timeout:.0f} s")
                    continue
                stuck.discard(t.kv_address)
                if item[0] == "layer" and t.transport != "shm":  # its buffer can be reused
                    self._returns.append((tracker if t.transport == "tcp" else _DONE, item[5][0]))
                if item[0] == "layer":
                    self.counters["layers_sent"] += 1
                    self.counters["bytes_sent"] += nbytes
        finally:
            for s in socks.values():
                s.close(linger=0)

    @classmethod
    def _hash_when_ready(cls, bufs: list[torch.Tensor], ready: Ready) -> int:
        ready.wait()
        return cls._hot_hash(bufs)

    def _write_remote(self, t: SendTarget, h: m.KVLayer, buf: torch.Tensor) -> bool:
        """buf [2, n, heads, dim]: its K and V rows into the decode worker's staging area."""
        if self.mooncake is None:
            return False
        for kv in (0, 1):
            off, length = t.layout.run(h.layer, kv, h.start, h.end)
            if not self.mooncake.write(
                t.peer_address, buf[kv], t.peer_base + t.offset + off, 64 << 20
            ):
                return False
        return True

    def _send(self, sock: zmq.Socket, frames: list, wait_s: float | None = None):
        """The send's tracker (done once ZeroMQ let go of the buffers), or None once ``wait_s``
        (default: send_timeout) passed."""
        deadline = time.monotonic() + (self.send_timeout if wait_s is None else wait_s)
        while True:
            try:
                return sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False, track=True)
            except zmq.Again:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                sock.poll(min(100, int(left * 1000) + 1), zmq.POLLOUT)
