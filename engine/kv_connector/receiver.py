"""The decode worker's side of the KV transfer, as an implementation of the KV-connector seam.

``expect`` (when the router places a request here) reserves the request's staging area. The
receiver thread takes ``KVLayer`` messages from any prefill worker (a PULL socket), checks each
against the request's layout (a known request, a layer in range, tokens in range and not
delivered before, the checksum of the bytes). Shared memory pieces were written into the staging
area by the sender; TCP pieces are received from their ZeroMQ frames into the staging area
(``recv_into``), so each frame's memory goes straight back to ZeroMQ and is reused for the next:
holding a transfer's frames until the scatter (90 MiB for 2,048 tokens) made every layer land in
freshly faulted pages and halved TCP throughput.
``KVDone`` ends the transfer: every layer must then cover every prompt token exactly once. The
worker is told through ``events`` (a bounded queue) and a wake callback, and admits the request
into its engine with the first token appended.

Then the seam: ``lookup`` answers the prompt tokens the transfer holds (the request's tokens
minus the last, the first token, which the decode worker computes), ``start_load`` notes where
they go, and ``finished_loads`` (engine thread, between steps) scatters them from the staging
area into the request's cache blocks. A failed transfer answers 0 (the decode
worker prefills the prompt itself: policy ``recompute``). The staging area is freed once every
choice loaded, or when the request ends, aborts or fails.

``inner`` is the decode worker's own KV pool (``--kv-pool``, or the host's pool service), as the
prefill worker's sender has one: the blocks the decode worker generates are saved to it, and a
request without a transfer (recompute after a failed one) looks its prefix up there.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
import zmq

from engine.cluster import messages as m
from engine.ipc import curve
from engine.ipc.liveness import DATA_TIMEOUT_MS, watch_peer
from engine.ipc.process_id import identify, is_gone
from engine.kv_connector.base import KVConnector, LoadDone, WrapsPool
from engine.kv_connector.device_copy import HostCopier, make_copier
from engine.kv_connector.staging import KVLayout, StagingArena, checksum, scatter_tokens
from engine.kv_connector.transfer_state import Transfer
from engine.pipeline_stage import PipelineStage

log = logging.getLogger(__name__)

QUARANTINE_S = 60.0  # a released area waits at most this long for a live sender to stop


class KVReceiver(WrapsPool):
    def __init__(
        self,
        kv_cache: torch.Tensor,
        block_size: int,
        arena: StagingArena,
        bind: str = "tcp://127.0.0.1:0",
        wake: Callable[[], None] | None = None,
        max_events: int = 4096,
        remote_writes: bool | None = None,
        inner: KVConnector | None = None,
        local_writers: bool | None = None,
        copier: HostCopier | None = None,
    ) -> None:
        """remote_writes: senders write into the arena themselves (shared memory, Mooncake), so
        an area released before its sender is done is quarantined. Default: the arena is shared.
        local_writers: those senders are processes of this host (shared memory), so the
        quarantine ends as soon as the sender's process is gone. Default: the arena is shared.
        Over Mooncake a peer's NIC writes: the quarantine runs its course (KVDone, KVAbort or
        QUARANTINE_S). inner: the worker's KV pool (saves, and loads of requests without a
        transfer). copier: how staged KV reaches the cache (default: the one for its device; on
        CUDA the arena, which TCP frames are received into too, is registered as pinned)."""
        self.kv = kv_cache
        self.copier = make_copier(kv_cache.device) if copier is None else copier
        self.copier.register(arena.buf)
        self.inner = inner
        self.per_layer = inner is not None and inner.per_layer
        self._inner_loads: set[str] = set()  # requests whose lookup the pool answered
        self.block_size = block_size
        self.arena = arena
        self.remote_writes = bool(arena.path) if remote_writes is None else remote_writes
        self.local_writers = bool(arena.path) if local_writers is None else local_writers
        layers, _, blocks, bs, heads, dim = kv_cache.shape
        self.num_layers = layers
        self.token_bytes = heads * dim * kv_cache.element_size()
        self._wake = wake or (lambda: None)
        self._lock = threading.Lock()
        self._transfers: dict[str, Transfer] = {}
        self._by_child: dict[str, Transfer] = {}
        self._loads: list[tuple[str, Transfer, list[int], int, int]] = []
        self.events: queue.Queue = queue.Queue(maxsize=max_events)  # request ids that finished
        self.counters = {"transfers": 0, "failed_transfers": 0, "bytes_received": 0}
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, m.MAX_FRAME_BYTES + m.MAX_HEADER_BYTES)
        watch_peer(self._sock, DATA_TIMEOUT_MS)
        curve.secure_server(self._sock, bind)
        self._sock.bind(bind)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._recv_loop, name="kv-receiver", daemon=True)
        self._thread.start()

    # -- the worker's calls -----------------------------------------------------------------

    def expect(
        self,
        request_id: str,
        num_tokens: int,
        deadline_s: float,
        sender_pid: int = 0,
        sender_local: bool = True,
        senders: int = 1,
        stage_pids: Sequence[int] = (),
        prompt_digest: bytes | None = None,
    ) -> Transfer:
        """Reserve staging for a request's prompt KV; MemoryError when the arena is full.
        sender_pid: the prefill worker the router placed the request on (0: not told, then a
        released area is quarantined until the sender is done or QUARANTINE_S); sender_local:
        it shares this process's /dev/shm and pid namespace (the router proved it,
        shm_proof.py), so its pid is watched; else it is elsewhere and sends frames. senders:
        the KVDone messages that end the transfer (a prefill group: one per stage, each for its
        own layers). stage_pids: a group's stages in order, each one's pid where it is local
        (watched, as sender_pid is), -1 where it is elsewhere, 0 unknown. prompt_digest: the
        prompt's (seal.py), which each KVDone's seal must cover (None: no seal checked)."""
        if not 1 <= senders <= self.num_layers:
            raise ValueError(f"senders must be in [1, {self.num_layers}], got {senders}")
        if stage_pids and len(stage_pids) != senders:
            raise ValueError(f"stage_pids must name {senders} stages, got {len(stage_pids)}")
        layout = KVLayout(self.num_layers, num_tokens, self.token_bytes)
        with self._lock:
            if request_id in self._transfers:
                raise ValueError(f"request_id {request_id!r} is already expected")
            offset = self.arena.alloc(layout.nbytes)
            if offset is None:
                raise MemoryError(
                    f"the KV staging area is full ({self.arena.used} of {self.arena.nbytes} "
                    f"bytes held; this request needs {layout.nbytes})"
                )
            t = Transfer(request_id, offset, layout, time.monotonic() + deadline_s, senders=senders)
            t.pieces = [[] for _ in range(self.num_layers)]
            t.prompt_digest = prompt_digest
            local = sender_local
            if sender_pid > 0 and local:
                # Identified while the router still counts it alive, so a pid reused later is
                # told apart. Watched while the transfer runs: a sender SIGKILLed mid-transfer
                # takes its unsent layers and KVDone with it, and the router, which may already
                # have its first token, no longer waits on it; expire() fails the transfer at
                # once rather than at the deadline.
                t.sender = identify(sender_pid)
            if self.local_writers and sender_pid > 0:
                if not local:
                    t.may_write = False  # it cannot map this host's memory: it sends frames
                else:
                    # Gone already, it will never write (no PrefillRequest).
                    t.writer = t.sender
                    t.may_write = t.writer is not None
            if stage_pids and self.local_writers:
                for i, pid in enumerate(stage_pids):
                    start = PipelineStage(i, senders).layer_range(self.num_layers).start
                    if pid == 0:
                        t.writers[start] = None  # unknown: it may write until it is done
                    elif pid > 0 and (w := identify(pid)) is not None:
                        t.writers[start] = w  # watched; gone already, it never writes
                    # -1: elsewhere, it sends frames
                t.may_write = bool(t.writers)
            self._transfers[request_id] = t
            self.counters["transfers"] += 1
            return t

    def get(self, request_id: str) -> Transfer | None:
        with self._lock:
            return self._transfers.get(request_id)

    def admit(self, request_id: str, children: list[str]) -> None:
        """The request joins the engine as these engine requests; each loads the staged KV."""
        with self._lock:
            t = self._transfers[request_id]
            t.children = set(children)
            for c in children:
                self._by_child[c] = t
            if not t.ok or not children:
                self._release(t)

    def release(self, request_id: str) -> None:
        """Forget a request (aborted, failed, or never admitted); frees its staging area. Over
        shared memory a prefill worker may still be writing into it until it hears of the abort,
        so the area is quarantined until the sender says it is done (or QUARANTINE_S passed)."""
        with self._lock:
            t = self._transfers.get(request_id)
            if t is not None:
                self._release(t)

    def _release(self, t: Transfer) -> None:
        """Lock held."""
        for c in t.children:
            self._by_child.pop(c, None)
        t.children.clear()
        if not t.finished:
            t.finished = True
            t.error = t.error or "released"
        if self._may_still_write(t):
            t.released_at = time.monotonic()
        else:
            self._free(t)

    def _may_still_write(self, t: Transfer) -> bool:
        """Lock held: whether a sender might still write into t's area, so it cannot be reused."""
        if not self.remote_writes or t.sender_done or not t.may_write:
            return False
        if t.inline:
            return False  # TCP: this side copies the frames; late ones are dropped
        if t.writers:  # a group: a stage not done whose process may be alive
            return any(
                start not in t.reported_by and (w is None or not is_gone(w))
                for start, w in t.writers.items()
            )
        if t.writer is None:
            return True  # not told who sends (Mooncake, or an older router): wait
        if is_gone(t.writer):
            t.may_write = False  # its memory maps died with it
            return False
        return True

    def expire(self, now: float) -> list[str]:
        """Transfers past their deadline without KVDone: failed (the worker applies the policy).
        Quarantined areas are freed once their sender's process is gone, or after QUARANTINE_S."""
        out = []
        with self._lock:
            for t in list(self._transfers.values()):
                if t.released_at is not None:
                    if now > t.released_at + QUARANTINE_S or not self._may_still_write(t):
                        self._free(t)
                elif not t.finished and now > t.deadline:
                    self._end(
                        t,
                        f"the KV transfer did not finish within its deadline; "
                        f"{sum(map(len, t.pieces))} of {self.num_layers}+ pieces came",
                    )
                    out.append(t.request_id)
                elif not t.finished and t.sender is not None and is_gone(t.sender):
                    self._end(
                        t,
                        f"the prefill worker sending it (pid {t.sender.pid}) is gone; "
                        f"{sum(map(len, t.pieces))} of {self.num_layers}+ pieces came",
                    )
                    out.append(t.request_id)
        return out

    def fail(self, request_id: str, reason: str) -> bool:
        """Fail request_id's transfer now if it is still under way (its sender is known to be
        gone, e.g. the router saw the prefill worker die on another host); the worker is told
        through ``events`` as for any failure. False when there is nothing to fail."""
        with self._lock:
            t = self._transfers.get(request_id)
            if t is None or t.finished or t.released_at is not None:
                return False
            self._end(t, reason)
            return t.finished

    @property
    def num_transfers(self) -> int:
        with self._lock:
            return len(self._transfers)

    # -- the seam (engine thread) -----------------------------------------------------------

    def lookup(self, req, block_hashes, num_device_tokens: int) -> int:
        with self._lock:
            t = self._by_child.get(req.request_id)
            if t is not None and t.ok and not t.freed:
                return max(0, min(req.num_tokens - 1, t.layout.num_tokens) - num_device_tokens)
        if self.inner is None:
            return 0
        n = self.inner.lookup(req, block_hashes, num_device_tokens)
        if n > 0:
            self._inner_loads.add(req.request_id)
        return n

    def start_load(self, req, block_table, start_token: int, num_tokens: int) -> None:
        if req.request_id in self._inner_loads:
            self._inner_loads.discard(req.request_id)
            self.inner.start_load(req, block_table, start_token, num_tokens)
            return
        with self._lock:
            t = self._by_child[req.request_id]
            self._loads.append((req.request_id, t, list(block_table), start_token, num_tokens))

    def finished_loads(self) -> list[LoadDone]:
        with self._lock:
            loads, self._loads = self._loads, []
        out = self.inner.finished_loads() if self.inner is not None else []
        for child, t, table, start, n in loads:
            with self._lock:
                live = not t.freed and child in t.children
            if not live:
                out.append(LoadDone(child, 0, {}, "the staged KV was released"))
                continue
            self._scatter(t, table, start, n)
            out.append(LoadDone(child, n, {"remote": n}))
            with self._lock:
                t.children.discard(child)
                self._by_child.pop(child, None)
                if not t.children:
                    self._free(t)
        return out

    def _scatter(self, t: Transfer, table: list[int], start: int, n: int) -> None:
        L, T = t.layout.num_layers, t.layout.num_tokens
        staged = self.arena.view(t.offset, t.layout.nbytes).view(self.kv.dtype)
        staged = staged.view(L, 2, T, *self.kv.shape[4:])[:, :, start : start + n]
        table_t = self.copier.index(table)
        ready = self.copier.fill_device(
            staged, lambda s: scatter_tokens(s, self.kv, table_t, start)
        )
        # The area may be freed (and written by the next sender) once this returns: registered
        # memory is not the caching host allocator's, which would hold it until the copy read it.
        ready.wait()

    def request_finished(self, req) -> None:
        with self._lock:
            t = self._by_child.pop(req.request_id, None)
            if t is not None:
                t.children.discard(req.request_id)
                if not t.children:
                    self._free(t)
        self._inner_loads.discard(req.request_id)
        if self.inner is not None:
            self.inner.request_finished(req)

    def save_layer(self, layer: int, step) -> None:
        if self.inner is not None and self.inner.per_layer:
            self.inner.save_layer(layer, step)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._sock.close(linger=0)
        if self.arena.buf is not None:  # the worker closes the arena after its connector
            self.copier.unregister(self.arena.buf)
        if self.inner is not None:
            self.inner.close()
            self.inner = None

    # -- internals --------------------------------------------------------------------------

    def _free(self, t: Transfer) -> None:
        """Lock held. The area goes back to the arena and the record is forgotten."""
        if not t.freed:
            t.freed = True
            self.arena.free(t.offset)
        t.released_at = None
        if self._transfers.get(t.request_id) is t:
            del self._transfers[t.request_id]

    def _end(self, t: Transfer, error: str | None) -> None:
        """Lock held: the transfer is over (done or failed); tell the worker once."""
        if t.finished:
            return
        t.finished = True
        if error is not None and t.error is None:
            t.error = error
            self.counters["failed_transfers"] += 1
        try:
            self.events.put_nowait(t.request_id)
        except queue.Full:
            log.error("receiver event queue full; %s will expire", t.request_id)
            t.finished = False
            return
        self._wake()

    def _recv_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                head = self._sock.recv(copy=False)
                rest = []
                if self._sock.getsockopt(zmq.RCVMORE):
                    if self._recv_direct(head.buffer):
                        continue
                    rest = self._recv_rest()
                msg = m.decode([head.buffer, *(f.buffer for f in rest)])
                self._handle(msg)
            except m.MessageError as exc:
                log.warning("bad KV message: %s", exc)
            except Exception:  # never let one message stop the receiver
                log.exception("error handling a KV message")

    def _recv_rest(self) -> list:
        frames = []
        while self._sock.getsockopt(zmq.RCVMORE):
            frames.append(self._sock.recv(copy=False))
        return frames

    def _recv_direct(self, head) -> bool:
        """A TCP layer for a live transfer whose checks pass: its K and V frames are received
        straight into the staging area (the lock is held for those two copies, so the area
        cannot be freed under them, and not while hashing). False: take the generic path (it
        drops the message or reports the problem)."""
        try:
            msg = m.decode([head], check_frames=False)
        except m.MessageError:
            return False
        if not isinstance(msg, m.KVLayer) or not msg.inline:
            return False
        length = (msg.end - msg.start) * self.token_bytes
        with self._lock:
            t = self._transfers.get(msg.request_id)
            if t is None or t.freed or t.finished or t.piece_problem(msg) is not None:
                return False
            views = self._views(t, msg)
            sizes = []
            for view in views:
                if not self._sock.getsockopt(zmq.RCVMORE):
                    break
                sizes.append(self._sock.recv_into(view))
            extra = len(self._recv_rest())  # frames past K and V are dropped
            err = None
            if sizes != [length, length] or extra:
                err = f"layer {msg.layer}: frames of {sizes + ['?'] * extra} bytes for 2 x {length}"
                self._end(t, err)
                return True
        if checksum(*views) != msg.checksum:
            err = f"layer {msg.layer}: checksum mismatch"
        with self._lock:
            if t.freed or t.finished:
                return True  # released or failed meanwhile: late data is dropped
            if err is not None:
                self._end(t, err)
            else:
                self._record(t, msg, length)
        return True

    def _handle(self, msg: m.Message) -> None:
        with self._lock:
            t = self._transfers.get(getattr(msg, "request_id", ""))
            if t is None or t.freed:
                return  # unknown or forgotten: late data is dropped
            if isinstance(msg, (m.KVDone, m.KVAbort)):
                t.reported += 1
                t.reported_by.add(msg.layer_start)
                t.sender_done = t.reported >= t.senders
                if t.sender_done and t.released_at is not None:
                    self._free(t)  # quarantine over: the sender writes no more
                    return
            if t.finished:
                return  # failed or expired already: late data is dropped
            if isinstance(msg, m.KVLayer):
                err = self._take_layer(t, msg)
                if err is not None:
                    self._end(t, err)
            elif isinstance(msg, m.KVDone):
                sealed = t.seal_problem(msg)
                err = t.completion_problem(msg) or sealed
                if msg.firsts and t.done is None and sealed is None:
                    t.done = msg  # kept on failure too: recompute goes on from these tokens
                if err is not None:
                    self._end(t, err)
                else:
                    t.done_ranges.append((msg.layer_start, msg.layer_end or t.layout.num_layers))
                    if t.complete:
                        self._end(t, None)
                        t.complete_time = time.monotonic()
            elif isinstance(msg, m.KVAbort):
                self._end(t, f"the prefill worker gave up: {msg.reason}")
            else:
                log.warning("unexpected %s on the KV socket", msg.TYPE)

    def _views(self, t: Transfer, msg: m.KVLayer):
        """The staging bytes of the piece's K rows and V rows (numpy views)."""
        lay = t.layout
        k_off, length = lay.run(msg.layer, 0, msg.start, msg.end)
        v_off, _ = lay.run(msg.layer, 1, msg.start, msg.end)
        base = self.arena.view(t.offset, lay.nbytes).numpy()
        return base[k_off : k_off + length], base[v_off : v_off + length]

    def _record(self, t: Transfer, msg: m.KVLayer, length: int) -> None:
        """Lock held: the piece is in (its bytes in the staging area)."""
        t.inline = msg.inline
        t.pieces[msg.layer].append((msg.start, msg.end))
        t.verified.append((msg.layer, msg.start, msg.end, msg.checksum))
        t.last_piece_time = time.monotonic()
        self.counters["bytes_received"] += 2 * length

    def _take_layer(self, t: Transfer, msg: m.KVLayer) -> str | None:
        err = t.piece_problem(msg)
        if err is not None:
            return err
        length = (msg.end - msg.start) * self.token_bytes
        if msg.inline:
            dk, dv = msg.frames
            if len(dk) != length or len(dv) != length:
                return f"layer {msg.layer}: {len(dk)} + {len(dv)} bytes for 2 x {length}"
            if checksum(dk, dv) != msg.checksum:
                return f"layer {msg.layer}: checksum mismatch"
            for view, frame in zip(self._views(t, msg), (dk, dv), strict=True):
                view[:] = np.frombuffer(frame, dtype=np.uint8)
            self._record(t, msg, length)
            return None
        if checksum(*self._views(t, msg)) != msg.checksum:
            return f"layer {msg.layer}: checksum mismatch"
        self._record(t, msg, length)
        return None
