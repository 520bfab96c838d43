"""Hidden states between the stages of a prefill group (chunked pipeline parallelism).

A group of N prefill stage workers each holds a range of the model's layers; a long prompt is
prefilled in chunks flowing stage 0 -> 1 -> ... -> N-1. Between two stages travel a chunk's
hidden states: rows [start, end) of the prompt, a tensor [end - start, hidden_size] in the
model's dtype. ``HiddenSender`` (stage i) pushes them, ``HiddenReceiver`` (stage i+1) takes
them, each on a thread of its own that alone touches its ZeroMQ sockets, over TCP (loopback on
one host), as ``StageHidden`` messages plus one raw frame (never pickle), or ``StageAbort``.

The sender copies the rows to bytes on the engine thread (the caller reuses its tensor) and
queues them (a bounded queue: a full one fails the request). Its thread sends them in the order
they were queued, so a healthy stream arrives in order: the first frame of a request is its
lowest (``s0``: rows before it were in the first stage's prefix cache and are never sent). A
send that waits ``send_timeout`` (the next stage gone or partitioned) fails the request; the
worker learns it from ``failures()``, woken by ``on_fail``. Sockets use ``IMMEDIATE``, so a
peer nobody listens for takes nothing and fails its sends at the timeout instead of queueing
frames forever; frames queued on a connection that then dies are lost, which the receiver's
deadline catches.

The receiving end, ``HiddenReceiver``, is in ``hidden_receiver.py``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import numpy as np
import torch
import zmq

from engine.cluster import messages as m
from engine.cluster.transfer.staging import checksum
from engine.ipc import curve
from engine.ipc.liveness import DATA_TIMEOUT_MS, watch_peer

log = logging.getLogger(__name__)

SEND_HWM = 64  # messages queued per next stage in ZeroMQ before sends wait
POLL_MS = 100  # how often the threads look at their stop flag


def row_bytes(rows: torch.Tensor) -> np.ndarray:
    """A copy of ``rows``' bytes in C order, as uint8 (any dtype, bfloat16 included, any
    device: a GPU tensor is copied to host memory)."""
    out = torch.empty(rows.numel(), dtype=rows.dtype)  # contiguous, whatever rows' strides
    out.copy_(rows.detach().reshape(-1))
    return out.view(torch.uint8).numpy()


# -- the sender (stage i) -----------------------------------------------------------------------


class HiddenSender:
    """Pushes hidden states to the next stages' receivers; see the module docstring."""

    def __init__(
        self,
        ctx: zmq.Context,
        send_timeout: float = 30.0,
        max_queue: int = 1024,
        on_fail: Callable[[], None] | None = None,
        put_timeout: float = 1.0,
    ) -> None:
        """send_timeout: how long one send may wait for the next stage to take it.
        put_timeout: how long ``send`` may wait on a full queue before failing the request."""
        if send_timeout <= 0 or max_queue < 1 or put_timeout < 0:
            raise ValueError("send_timeout must be > 0, max_queue >= 1, put_timeout >= 0")
        self._ctx = ctx
        self.send_timeout = send_timeout
        self.put_timeout = min(put_timeout, send_timeout)
        self._on_fail = on_fail or (lambda: None)
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()
        self._failed: set[str] = set()  # requests that send nothing more
        self._failures: list[tuple[str, str]] = []  # not yet seen by the worker
        self.counters = {"frames_sent": 0, "bytes_sent": 0, "aborts_sent": 0, "failed": 0}
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="stage-sender", daemon=True)
        self._thread.start()

    # -- the engine thread's calls --------------------------------------------------------------

    def send(self, request_id: str, address: str, start: int, end: int, rows: torch.Tensor) -> bool:
        """Queue rows [start, end) of request_id's hidden states (``rows``: [end - start,
        hidden_size], copied here) for the receiver at ``address``. False when the request has
        failed (nothing is queued); ValueError for rows that do not match [start, end)."""
        if self._closed:
            raise RuntimeError("the hidden-state sender is closed")
        if not 0 <= start < end or rows.dim() != 2 or rows.shape[0] != end - start:
            raise ValueError(
                f"rows [{start}, {end}) need a 2-d tensor of {end - start} rows, got shape "
                f"{tuple(rows.shape)}"
            )
        if self.failed(request_id):
            return False
        data = row_bytes(rows)
        header = m.StageHidden(request_id, start, end, checksum(data), frames=(data,))
        return self._put(request_id, ("hidden", request_id, address, m.encode(header), data.nbytes))

    def abort(self, request_id: str, address: str, reason: str) -> None:
        """Tell the receiver at ``address`` that this stage gave up on the request (best effort:
        not when the queue is full; the receiver's deadline then applies)."""
        if self._closed:
            return
        frames = m.encode(m.StageAbort(request_id, reason))
        try:
            self._queue.put_nowait(("abort", request_id, address, frames, 0))
        except queue.Full:
            log.warning("stage abort of %s not sent: the send queue is full", request_id)

    def failed(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._failed

    def failures(self) -> list[tuple[str, str]]:
        """[(request_id, reason)] of the requests that failed since the last call."""
        with self._lock:
            out, self._failures = self._failures, []
        return out

    def forget(self, request_id: str) -> None:
        """The worker is done with the request (its failure, if any, was seen)."""
        with self._lock:
            self._failed.discard(request_id)

    def close(self) -> None:
        """Stop the thread (frames still queued are dropped) and close its sockets."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=self.send_timeout + 5.0)
        if self._thread.is_alive():
            log.error("the hidden-state sender thread did not stop")

    # -- internals ------------------------------------------------------------------------------

    def _put(self, request_id: str, item: tuple) -> bool:
        try:
            self._queue.put(item, timeout=self.put_timeout)
            return True
        except queue.Full:
            self._fail(request_id, "the hidden-state send queue stayed full")
            return False

    def _fail(self, request_id: str, reason: str) -> None:
        with self._lock:
            if request_id in self._failed:
                return
            self._failed.add(request_id)
            self._failures.append((request_id, reason))
            self.counters["failed"] += 1
        log.warning("hidden states of %s not sent: %s", request_id, reason)
        try:
            self._on_fail()
        except Exception:
            log.exception("the sender's on_fail callback failed")

    def _loop(self) -> None:
        socks: dict[str, zmq.Socket] = {}
        # Addresses whose last send waited out send_timeout: until one send there goes
        # through, each is tried once, not waited for, so the frames queued behind (to it and
        # to every other stage) are not held send_timeout each.
        stuck: set[str] = set()
        try:
            while not self._stop.is_set():
                try:
                    item = self._queue.get(timeout=POLL_MS / 1000)
                except queue.Empty:
                    continue
                try:
                    self._send_item(item, socks, stuck)
                except Exception as exc:  # one bad item fails its request, not the thread
                    log.exception("error sending hidden states")
                    self._fail(item[1], f"send error: {exc}")
        finally:
            for s in socks.values():
                s.close(linger=0)

    def _send_item(self, item: tuple, socks: dict[str, zmq.Socket], stuck: set[str]) -> None:
        kind, request_id, address, frames, nbytes = item
        if kind == "hidden" and self.failed(request_id):
            return
        sock = socks.get(address)
        if sock is None:
            try:
                sock = self._connect(address)
            except zmq.ZMQError as exc:  # a bad address fails its request only
                self._fail(request_id, f"cannot connect to {address!r}: {exc}")
                return
            socks[address] = sock
        if not self._send(sock, frames, 0.0 if address in stuck else self.send_timeout):
            if self._stop.is_set():
                return
            stuck.add(address)
            if kind == "hidden":
                self._fail(
                    request_id,
                    f"the next stage at {address} took nothing for {self.send_timeout:g} s",
                )
            return
        stuck.discard(address)
        if kind == "hidden":
            self.counters["frames_sent"] += 1
            self.counters["bytes_sent"] += nbytes
        else:
            self.counters["aborts_sent"] += 1

    def _connect(self, address: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.PUSH)
        try:
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # nobody listening: sends wait, then fail
            watch_peer(sock, DATA_TIMEOUT_MS)  # reconnects after a partition
            curve.secure_client(sock)
            sock.connect(address)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        return sock

    def _send(self, sock: zmq.Socket, frames: list, wait_s: float) -> bool:
        """Whether ZeroMQ took the message within ``wait_s`` (and before close)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    return False
                sock.poll(min(POLL_MS, int(left * 1000) + 1), zmq.POLLOUT)
