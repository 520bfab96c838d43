"""The receiving end of the hidden-state link between the stages of a prefill group
(``stage_link.py`` describes the link and its sending end): ``HiddenReceiver`` (stage i + 1)
takes a chunk's hidden states from the stage before on a thread of its own that alone touches
its ZeroMQ PULL socket.

The receiver checks every frame: its header decodes, it is a ``StageHidden`` or ``StageAbort``,
``0 <= start < end <= num_tokens``, the frame holds ``(end - start) * hidden_size * itemsize``
bytes, its checksum matches. A bad frame fails its request (the error names the problem); one
that does not decode is counted and dropped. Rows are delivered exactly once: a frame may come
in any order, repeated or overlapping (a recompute on the stage before resends rows); rows
already held are kept and the repeat is ignored. Frames for a request not yet expected (its
``PrefillRequest`` and the first frame from the stage before race) wait in a small bounded
early buffer and are applied by ``expect``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import zmq

from engine.cluster import messages as m
from engine.cluster.transfer.staging import checksum
from engine.cluster.worker.stage_link import POLL_MS
from engine.ipc import curve
from engine.ipc.liveness import DATA_TIMEOUT_MS, watch_peer

log = logging.getLogger(__name__)

EARLY_FRAMES = 64  # frames held for requests not expected yet
EARLY_BYTES = 64 << 20
EARLY_S = 10.0  # an early frame not claimed by expect within this is dropped
RELEASED_KEEP = 1024  # recently released requests whose late frames are dropped at once


@dataclass
class _Stream:
    """One expected request's rows (lock held for every access)."""

    num_tokens: int
    buf: torch.Tensor  # [num_tokens, hidden_size]
    deadline: float
    have: np.ndarray  # [num_tokens] bool: rows held
    first_start: int | None = None
    ready: int = 0
    error: str | None = None

    @property
    def complete(self) -> bool:
        return self.first_start is not None and self.ready == self.num_tokens


@dataclass
class _Early:
    """A frame for a request not expected yet: its message, its frame-level problem, when."""

    msg: m.Message
    problem: str | None
    nbytes: int
    at: float = field(default_factory=time.monotonic)


class HiddenReceiver:
    """Takes hidden states from the stage before; see the module docstring.

    ``first_start(r)``: the start of the first frame received for r (None before one came).
    The sender sends in order, so in a healthy stream that is the lowest, s0. It never changes
    once set: rows below it that come later (disorder, a resend from lower) are kept but do not
    move it. ``ready(r)``: the end of the contiguous run of held rows from first_start (rows
    first_start.. ready have all arrived, whatever order the frames came in).
    Calls for a request that is not expected raise KeyError."""

    def __init__(
        self,
        ctx: zmq.Context,
        bind: str,
        hidden_size: int,
        dtype: torch.dtype,
        wake: Callable[[], None] | None = None,
        max_bytes: int = 1 << 30,
    ) -> None:
        if hidden_size < 1 or max_bytes < 1:
            raise ValueError(f"hidden_size ({hidden_size}) and max_bytes must be >= 1")
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.row_nbytes = hidden_size * torch.empty((), dtype=dtype).element_size()
        self.max_bytes = max_bytes
        self._wake = wake or (lambda: None)
        self._lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._used = 0
        self._early: dict[str, list[_Early]] = {}
        self._early_frames = 0
        self._early_bytes = 0
        self._released: OrderedDict[str, None] = OrderedDict()
        # Request ids whose state changed, once each: expected requests only (release drops its
        # own), so it never holds more than num_requests and nothing is ever dropped.
        self._events: OrderedDict[str, None] = OrderedDict()
        self.counters = {
            "frames": 0,  # frames handled (bad or good), for tests and /health
            "bad_frames": 0,  # did not decode or were no stage message: dropped
            "rows_received": 0,  # new rows (repeats not counted)
            "repeats": 0,  # frames whose rows were all held already
            "early_dropped": 0,
            "failed": 0,
        }
        self._sock = ctx.socket(zmq.PULL)
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            frame_limit = min(max_bytes, m.MAX_FRAME_BYTES)
            self._sock.setsockopt(zmq.MAXMSGSIZE, frame_limit + m.MAX_HEADER_BYTES)
            watch_peer(self._sock, DATA_TIMEOUT_MS)
            curve.secure_server(self._sock, bind)
            self._sock.bind(bind)
            self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception:
            self._sock.close(linger=0)
            raise
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="stage-receiver", daemon=True)
        self._thread.start()

    # -- the worker's calls ---------------------------------------------------------------------

    def expect(self, request_id: str, num_tokens: int, deadline_s: float) -> None:
        """Hold rows [0, num_tokens) of request_id, due within deadline_s seconds; frames that
        came before are applied now. MemoryError past max_bytes, ValueError for bad arguments."""
        if not request_id or num_tokens < 1:
            raise ValueError(f"need a request id and num_tokens >= 1, got {num_tokens}")
        if not (deadline_s > 0 and math.isfinite(deadline_s)):
            raise ValueError(f"deadline_s must be a positive number of seconds, got {deadline_s}")
        nbytes = num_tokens * self.row_nbytes
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already expected")
            if self._used + nbytes > self.max_bytes:
                raise MemoryError(
                    f"hidden-state buffers full: {self._used} of {self.max_bytes} bytes held, "
                    f"{request_id} needs {nbytes}"
                )
            s = _Stream(
                num_tokens,
                torch.empty(num_tokens, self.hidden_size, dtype=self.dtype),
                time.monotonic() + deadline_s,
                np.zeros(num_tokens, dtype=bool),
            )
            self._streams[request_id] = s
            self._used += nbytes
            self._released.pop(request_id, None)
            early = self._early.pop(request_id, [])
            changed = False
            for e in early:
                self._early_frames -= 1
                self._early_bytes -= e.nbytes
                changed |= self._apply(request_id, s, e.msg, e.problem)
            if changed:
                self._event(request_id)
        if changed:
            self._wake()

    def first_start(self, request_id: str) -> int | None:
        with self._lock:
            return self._streams[request_id].first_start

    def ready(self, request_id: str) -> int:
        with self._lock:
            return self._streams[request_id].ready

    def rows(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """A view of rows [start, end) of the request's buffer; ValueError unless all arrived.
        Rows once held are never written again, so the view stays valid (after ``release``
        too: it keeps the memory)."""
        with self._lock:
            s = self._streams[request_id]
            if not (0 <= start <= end <= s.num_tokens and s.have[start:end].all()):
                raise ValueError(f"rows [{start}, {end}) of {request_id} have not all arrived")
            return s.buf[start:end]

    def error(self, request_id: str) -> str | None:
        with self._lock:
            return self._streams[request_id].error

    def events(self) -> list[str]:
        """Requests whose state changed (new rows, failed, aborted) since the last call."""
        with self._lock:
            out = list(self._events)
            self._events.clear()
        return out

    def expire(self, now: float) -> list[str]:
        """Requests past their deadline without all their rows: failed, and returned. Early
        frames older than EARLY_S are dropped."""
        out = []
        with self._lock:
            for rid, s in self._streams.items():
                if s.error is None and not s.complete and now > s.deadline:
                    got = "no rows" if s.first_start is None else f"rows up to {s.ready}"
                    self._fail(
                        rid, s, f"the stage before sent {got} of {s.num_tokens} in its deadline"
                    )
                    out.append(rid)
            self._prune_early(now)
        return out

    def release(self, request_id: str) -> None:
        """Forget the request and free its buffer; its late frames are dropped."""
        with self._lock:
            s = self._streams.pop(request_id, None)
            if s is not None:
                self._used -= s.num_tokens * self.row_nbytes
            self._events.pop(request_id, None)
            self._drop_early(request_id)
            self._released[request_id] = None
            while len(self._released) > RELEASED_KEEP:
                self._released.popitem(last=False)

    @property
    def num_requests(self) -> int:
        with self._lock:
            return len(self._streams)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=10.0)
        if self._thread.is_alive():
            log.error("the hidden-state receiver thread did not stop")
        else:
            self._sock.close(linger=0)

    # -- the receiver thread --------------------------------------------------------------------

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(POLL_MS):
                    continue
                frames = self._sock.recv_multipart(copy=False)
            except Exception:
                log.exception("error receiving a hidden-state message")
                self._stop.wait(POLL_MS / 1000)  # not a hot loop if it persists
                continue
            try:
                self._take([f.buffer for f in frames])
            except Exception:  # never let one message stop the receiver
                log.exception("error handling a hidden-state message")
            finally:
                self.counters["frames"] += 1  # handled: its effects are visible

    def _take(self, frames: list) -> None:
        try:
            msg = m.decode(frames[:1], check_frames=False)
        except m.MessageError as exc:
            self.counters["bad_frames"] += 1
            log.warning("bad hidden-state message dropped: %s", exc)
            return
        if not isinstance(msg, (m.StageHidden, m.StageAbort)):
            self.counters["bad_frames"] += 1
            log.warning("unexpected %s on the hidden-state socket: dropped", msg.TYPE)
            return
        data = frames[1:]
        problem = None
        if isinstance(msg, m.StageHidden):
            problem = self._frame_problem(msg, data)
            msg = m.StageHidden(msg.request_id, msg.start, msg.end, msg.checksum, frames=data)
        rid = msg.request_id
        changed = False
        with self._lock:
            s = self._streams.get(rid)
            if s is not None:
                changed = self._apply(rid, s, msg, problem)
                if changed:
                    self._event(rid)
            elif rid not in self._released:
                self._hold_early(rid, msg, problem, sum(len(f) for f in data))
        if changed:
            self._wake()

    def _frame_problem(self, msg: m.StageHidden, data: list) -> str | None:
        """What is wrong with the frame, as far as it can be told without its request."""
        where = f"rows [{msg.start}, {msg.end})"
        if not 0 <= msg.start < msg.end:
            return f"{where}: not a range (0 <= start < end)"
        if len(data) != 1:
            return f"{where}: {len(data)} data frames, expected 1"
        want = (msg.end - msg.start) * self.row_nbytes
        if len(data[0]) != want:
            return f"{where}: frame of {len(data[0])} bytes, expected {want}"
        if checksum(data[0]) != msg.checksum:
            return f"{where}: checksum mismatch"
        return None

    def _apply(self, rid: str, s: _Stream, msg: m.Message, problem: str | None) -> bool:
        """Lock held: a message for an expected request. Whether its state changed."""
        if s.error is not None:
            return False  # failed already: late frames are dropped
        if isinstance(msg, m.StageAbort):
            self._fail(rid, s, f"the stage before gave up: {msg.reason}")
            return True
        assert isinstance(msg, m.StageHidden)
        if problem is None and msg.end > s.num_tokens:
            problem = f"rows [{msg.start}, {msg.end}): out of range (num_tokens {s.num_tokens})"
        if problem is not None:
            self._fail(rid, s, f"bad hidden states: {problem}")
            return True
        new = ~s.have[msg.start : msg.end]
        n_new = int(new.sum())
        if n_new == 0:
            self.counters["repeats"] += 1
            return False
        src = np.frombuffer(msg.frames[0], dtype=np.uint8).reshape(-1, self.row_nbytes)
        dst = s.buf.view(torch.uint8).numpy()[msg.start : msg.end]
        if n_new == len(new):
            dst[:] = src
        else:
            dst[new] = src[new]  # overlapping a held range: only the rows not held yet
        s.have[msg.start : msg.end] = True
        self.counters["rows_received"] += n_new
        if s.first_start is None:
            s.first_start = s.ready = msg.start
        if msg.start <= s.ready:
            rest = np.flatnonzero(~s.have[s.ready :])
            s.ready = s.ready + int(rest[0]) if rest.size else s.num_tokens
        return True

    def _fail(self, rid: str, s: _Stream, error: str) -> None:
        """Lock held."""
        s.error = error
        self.counters["failed"] += 1
        log.warning("hidden states of %s failed: %s", rid, error)
        self._event(rid)

    def _event(self, rid: str) -> None:
        """Lock held: tell the worker (once per id until it drains ``events``)."""
        self._events[rid] = None

    def _hold_early(self, rid: str, msg: m.Message, problem: str | None, nbytes: int) -> None:
        """Lock held: keep a frame for a request not expected yet, within the early limits."""
        self._prune_early(time.monotonic())
        if self._early_frames >= EARLY_FRAMES or self._early_bytes + nbytes > EARLY_BYTES:
            self.counters["early_dropped"] += 1
            log.warning("early hidden states of %s dropped: the early buffer is full", rid)
            return
        self._early.setdefault(rid, []).append(_Early(msg, problem, nbytes))
        self._early_frames += 1
        self._early_bytes += nbytes

    def _prune_early(self, now: float) -> None:
        """Lock held."""
        for rid in [r for r, es in self._early.items() if now > es[0].at + EARLY_S]:
            self.counters["early_dropped"] += len(self._early[rid])
            self._drop_early(rid)

    def _drop_early(self, rid: str) -> None:
        """Lock held."""
        for e in self._early.pop(rid, []):
            self._early_frames -= 1
            self._early_bytes -= e.nbytes
