"""Each request's phases, driven by what its workers say: placed on a prefill and a decode
worker -> ``DecodeRequest`` (the decode worker reserves staging; ``reserving``) -> when the
placement planned a block copy to the prefill worker, its ``CopyDone`` or its deadline
(``copying``) -> ``PrefillRequest`` (the prefill worker streams KV to the decode worker and
reports the first tokens; ``prefill``) -> the decode worker's tokens (``decode``).

Faults: a request whose worker dies, or that a worker refuses (overloaded, draining), is placed
again while the client has seen nothing of it (up to ``max_retries``); after its first token it
ends with a clear error (503). Every phase has a deadline, so no request waits forever. Runs on
the router's IO thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from engine.cluster import messages as m
from engine.cluster.placement import Placement
from engine.cluster.router import shm_pairs
from engine.cluster.router.config import ClusterUnavailableError, RouterConfig
from engine.cluster.router.membership import Membership, Worker
from engine.cluster.router.outputs import apply_outputs, assemble, integrity_problem
from engine.cluster.router.request import RouterRequest
from engine.core.metrics import EngineMetrics
from engine.errors import RequestError
from engine.ipc.wire import params_to_wire
from engine.kvcache.prefix_hash import hash_blocks

log = logging.getLogger(__name__)

Send = Callable[[Worker, m.Message], bool]  # False: the worker could not be reached
MAX_ABANDONED = 100_000  # attempts remembered per dead worker, to abort should it come back
# A request refused for room in a decode worker's KV staging area waits this long before it is
# placed again, doubling up to ROOM_WAIT_MAX_S (an aborted transfer's area is held until its
# sender stops writing: receiver.py QUARANTINE_S), until its own deadline.
ROOM_WAIT_S, ROOM_WAIT_MAX_S = 0.25, 4.0


class Phases:
    def __init__(
        self,
        cfg: RouterConfig,
        members: Membership,
        placement: Placement,
        stats: EngineMetrics,
        send: Send,
    ) -> None:
        self.cfg = cfg
        self.members = members
        self.placement = placement
        self.stats = stats
        self._send = send
        self.requests: dict[str, RouterRequest] = {}  # by the caller's request id
        self.wire: dict[str, RouterRequest] = {}  # by the current attempt's id

    # -- the caller's commands --------------------------------------------------------------

    def submit(self, req: RouterRequest) -> None:
        if req.request_id in self.requests:
            req.deliver(RequestError(f"request_id {req.request_id!r} is in use", "request_id"))
            return
        self.requests[req.request_id] = req
        with self.stats.lock:
            self.stats.prompt_tokens += len(req.ids) * req.params.n
        self._place(req)

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None:
            self._abort_legs(req)
            self._finish(req, "abort")

    def abort_all(self) -> None:
        for request_id in list(self.requests):
            self.abort(request_id)

    def fail_all(self, exc: BaseException) -> None:
        for req in list(self.requests.values()):
            self._fail(req, exc)

    # -- what workers say -------------------------------------------------------------------

    def on_message(self, sender: Worker, msg: m.Message, now: float) -> None:
        req = self.wire.get(getattr(msg, "request_id", ""))
        if req is None:
            return  # finished, aborted or an abandoned attempt: late messages are dropped
        wid = sender.worker_id
        if isinstance(msg, m.DecodeReady):
            if wid != req.decode or req.phase != "reserving":
                return
            if msg.error is not None:
                if msg.full:
                    self._wait_for_room(req, f"decode worker {wid}: {msg.error}")
                else:
                    self._retry(req, f"decode worker {wid}: {msg.error}")
                return
            if req.copy_wait:  # the prefill starts when the copy is in (or late)
                req.ready, req.phase = (sender, msg), "copying"
                req.phase_deadline = time.monotonic() + self.cfg.copy_timeout_s
                return
            self._start_prefill(req, sender, msg)
        elif isinstance(msg, m.CopyDone):
            if wid != req.prefill or not req.copy_wait:
                return
            req.copy_wait = False
            self.placement.copy_done(req.wire_id, msg.blocks)
            if req.phase == "copying":
                self._start_prefill(req, *req.ready)
        elif isinstance(msg, m.Outputs):
            last = req.legs[-1] if req.legs else ""  # a group's last stage samples
            if wid not in (last, req.decode):
                return
            problem = integrity_problem(req, msg.outputs)
            if problem is not None:  # refused, not answered
                log.error("request %s: %s (worker %s)", req.request_id, problem, wid)
                self._abort_legs(req)
                self._fail(req, ClusterUnavailableError(f"request {req.request_id}: {problem}"))
                return
            if wid == last and req.phase == "prefill":
                req.phase = "decode"
                req.metrics.num_cached_tokens = msg.num_cached_tokens
                self.placement.prefill_done(req.wire_id, now, msg.num_cached_tokens)
            if wid == last:
                # The decode worker learns the first tokens the client gets, in case the KV
                # transfer fails before its KVDone: it then recomputes from these.
                d = self.members.reachable(req.decode)
                if d is not None:
                    self._send(d, m.FirstTokens(req.wire_id, msg.outputs))
            apply_outputs(req, msg.outputs)
            self._emit(req)
        elif isinstance(msg, m.TransferFailed):
            if wid != req.decode:
                return
            for leg in req.legs:
                p = self.members.workers.get(leg)
                if p is not None:
                    self._send(p, m.Abort(req.wire_id))
            if msg.recompute:
                req.phase = "decode"  # the decode worker prefills it itself
                req.phase_deadline = time.monotonic() + self.cfg.request_timeout_s
            else:
                self._abort_legs(req)
                why = f"request {req.request_id}: KV transfer failed: {msg.reason}"
                self._fail(req, ClusterUnavailableError(why))  # 503 naming it
        elif isinstance(msg, m.RequestError):
            if wid not in (*req.legs, req.decode):
                return
            if msg.code in (429, 503):
                self._retry(req, f"worker {wid}: {msg.message}")
                return
            self._abort_legs(req)
            if msg.code == 400:
                exc: Exception = RequestError(msg.message, msg.param)
            else:
                exc = RuntimeError(msg.message)
            self._fail(req, exc)

    def worker_died(self, w: Worker) -> None:
        for req in list(self.requests.values()):
            if w.worker_id not in (*req.legs, req.decode):
                continue
            if len(w.abandoned) < MAX_ABANDONED:  # aborted there should it come back
                w.abandoned.append(req.wire_id)
            if w.worker_id in req.legs and req.phase == "decode":
                # Its part is done (a group's: every stage's, as the last one sampled); the
                # decode worker carries on.
                req.prefill, req.legs = "", ()
                d = self.members.reachable(req.decode)
                if d is not None:
                    # Its KV may not all have left: the decode worker need not wait out the
                    # transfer deadline (it recomputes from the first tokens).
                    self._send(d, m.SourceGone(req.wire_id, w.worker_id))
                continue
            if w.worker_id in req.legs:
                # A stage of a group: the others drop the request (_retry aborts the legs)
                req.legs = tuple(leg for leg in req.legs if leg != w.worker_id)
            else:
                req.decode = ""
            self._retry(req, f"worker {w.worker_id} died")

    def check_deadlines(self, now: float) -> None:
        for req in list(self.requests.values()):
            if now > req.deadline:
                self._abort_legs(req)
                self._fail(req, TimeoutError(f"request {req.request_id} passed its deadline"))
            elif req.phase == "copying" and now > req.phase_deadline:
                req.copy_wait = False  # the copy is late: prefill without it
                self._start_prefill(req, *req.ready)
            elif req.phase in ("reserving", "prefill") and now > req.phase_deadline:
                self._retry(req, f"no progress in the {req.phase} phase")
            elif req.phase == "waiting" and now > req.phase_deadline:
                self._place(req)

    # -- the phases -------------------------------------------------------------------------

    def _place(self, req: RouterRequest) -> None:
        placed = self.placement.place(
            req.ids, self.members.live("prefill"), self.members.live("decode"), req.priority
        )
        if placed is None:
            exc = self.placement.rejection_error()  # an SLO's: 429
            self._fail(req, exc or ClusterUnavailableError("no live prefill and decode workers"))
            return
        req.prefill, req.decode = placed
        legs = self.members.stage_workers(req.prefill)
        if not legs:
            self._fail(req, ClusterUnavailableError(f"prefill unit {req.prefill} is not up"))
            return
        req.legs = tuple(w.worker_id for w in legs)
        req.phase = "reserving"
        req.phase_deadline = time.monotonic() + self.cfg.phase_timeout_s
        # A fresh id per attempt: late messages of an abandoned attempt can never be taken for
        # this one's (by the router, or by a decode worker's staging area).
        self.wire.pop(req.wire_id, None)
        req.wire_id = f"{req.request_id}/{req.attempts}"
        self.wire[req.wire_id] = req
        self.placement.bind(req.wire_id)
        req.ready = None
        req.copy_wait = self._start_copies(req)
        # One sender: the decode worker may watch its pid where they share a kernel. A group
        # has one per stage (each sends its own layers); the router tells of a stage's death.
        p, d = legs[0], self.members.workers[req.decode]
        alone = len(legs) == 1
        req.shm_legs = tuple(shm_pairs.shares_memory(s, d) for s in legs)
        msg = m.DecodeRequest(
            req.wire_id,
            req.ids,
            params_to_wire(req.params),
            self.cfg.transfer_deadline_s,
            # (0 where it may write into the decode worker's memory but its pid cannot be
            # watched there: the decode worker then waits for its KVDone or KVAbort)
            sender_pid=p.pid if alone and _stage_pid(p, d) != 0 else 0,
            sender_local=alone and shm_pairs.shares_pids(p, d),
            senders=len(legs),
            stage_pids=[] if alone else [_stage_pid(s, d) for s in legs],
            priority=req.priority,
        )
        if not self._send(self.members.workers[req.decode], msg):
            self._retry(req, f"decode worker {req.decode} is unreachable")

    def _start_copies(self, req: RouterRequest) -> bool:
        """Ask the source of each block copy the placement planned between prefill workers to
        send it (block_copy.py); True if one was sent. Copies from a pool need nothing: the
        prefill worker's pool lookup performs them."""
        sent = False
        workers = self.members.workers
        for src_id, dst_id, start, end in self.placement.planned_copies():
            src, dst = workers.get(src_id), workers.get(dst_id)
            if src is None or dst is None or dst_id != req.prefill or not dst.copy_address:
                continue
            if src.role != "prefill" or src.state != "up" or end <= start:
                continue
            bs = self.cfg.block_size
            msg = m.CopyBlocks(req.wire_id, req.ids[: end * bs], start, dst.copy_address)
            sent = self._send(src, msg) or sent
        return sent

    def _start_prefill(self, req: RouterRequest, decode: Worker, ready: m.DecodeReady) -> None:
        legs = [self.members.workers.get(leg) for leg in req.legs]
        if not legs or any(p is None or p.state != "up" for p in legs):
            self._retry(req, f"prefill unit {req.prefill} is gone")
            return
        req.phase = "prefill"
        req.phase_deadline = time.monotonic() + self.cfg.phase_timeout_s
        self.placement.prefill_started(req.wire_id, time.monotonic())
        prefix = self._group_prefix(req, legs) if len(legs) > 1 else -1
        for i, p in enumerate(legs):
            transport = self._transport(p, decode)
            if transport == "shm" and not (i < len(req.shm_legs) and req.shm_legs[i]):
                transport = "tcp"  # the decode worker was told this leg sends frames
            p.kv_transports[transport] = p.kv_transports.get(transport, 0) + 1
            mooncake = transport == "mooncake"
            msg = m.PrefillRequest(
                req.wire_id,
                req.ids,
                params_to_wire(req.params),
                decode.worker_id,
                decode.kv_address,
                transport,
                decode.shm_path if transport == "shm" else "",
                ready.offset,
                ready.nbytes,
                stream_layers=self.cfg.stream_layers,
                peer_address=decode.mooncake_address if mooncake else "",
                peer_base=decode.arena_addr if mooncake else 0,
                stage_next=legs[i + 1].hidden_address if i + 1 < len(legs) else "",
                prefix_tokens=prefix if i == 0 else -1,
                deadline_s=self.cfg.transfer_deadline_s,
                priority=req.priority,
            )
            if not self._send(p, msg):
                self._retry(req, f"prefill worker {p.worker_id} is unreachable")
                return

    def _transport(self, p: Worker, decode: Worker) -> str:
        """How prefill worker p sends KV to the decode worker."""
        transport = self.cfg.kv_transport
        same_host = shm_pairs.shares_memory(p, decode)  # proven, never by hostname
        if decode.mooncake_address and (transport or decode.transport) == "mooncake":
            transport = "mooncake"  # both ends must have joined with their Transfer Engines
        elif transport is None:
            transport = "shm" if same_host and decode.transport == "shm" else "tcp"
        elif transport != "tcp" and not same_host:
            transport = "tcp"
        return transport

    def _group_prefix(self, req: RouterRequest, legs: list[Worker]) -> int:
        """The cached prefix (tokens) every stage of a group holds, by their block events: the
        first stage reuses at most that much, and every later stage then starts where it did
        (a stage lacking it fails the attempt, which is placed again)."""
        bs = self.cfg.block_size
        hashes = hash_blocks(req.ids, bs)
        return bs * min(self.members.prefix_blocks(p.worker_id, hashes) for p in legs)

    # -- endings ----------------------------------------------------------------------------

    def _retry(self, req: RouterRequest, why: str) -> None:
        self._abort_legs(req)
        if req.streamed or req.attempts - req.waits >= self.cfg.max_retries:
            self._fail(req, ClusterUnavailableError(f"request {req.request_id}: {why}"))
            return
        self.placement.finished(req.wire_id, time.monotonic())  # this attempt is abandoned
        req.attempts += 1
        log.warning("request %s: %s; placing it again", req.request_id, why)
        self._place(req)

    def _wait_for_room(self, req: RouterRequest, why: str) -> None:
        """The decode worker's KV staging area has no room for this request now: room comes as
        transfers end, so the request waits (ROOM_WAIT_S, doubling) and is placed anew, until
        its deadline (then a 408), instead of being refused again at once and failed. Back
        pressure, not an error: a long prompt's KV is most of the area."""
        self._abort_legs(req)
        self.placement.finished(req.wire_id, time.monotonic())  # this attempt is abandoned
        req.attempts += 1
        req.waits += 1
        req.phase = "waiting"
        wait = min(ROOM_WAIT_MAX_S, ROOM_WAIT_S * 2 ** min(req.waits - 1, 8))
        req.phase_deadline = time.monotonic() + wait
        if req.waits == 1:
            log.info("request %s: %s; waiting for room", req.request_id, why)

    def _abort_legs(self, req: RouterRequest) -> None:
        for wid in (*req.legs, req.decode):
            w = self.members.reachable(wid)
            if w is not None and not self._send(w, m.Abort(req.wire_id)):
                # Its connection is down (a partition the heartbeats have not shown yet): the
                # Abort goes when it registers again (Router.on_message), so its staging and
                # blocks do not wait for its own deadlines.
                if len(w.abandoned) < MAX_ABANDONED:
                    w.abandoned.append(req.wire_id)
        req.prefill = req.decode = ""
        req.legs = ()

    def _fail(self, req: RouterRequest, exc: BaseException) -> None:
        self.placement.finished(req.wire_id, time.monotonic())
        self._forget(req)
        with self.stats.lock:
            self.stats.finished["error"] = self.stats.finished.get("error", 0) + 1
        req.deliver(exc)

    def _finish(self, req: RouterRequest, reason: str) -> None:
        """End req now (an abort): unfinished choices get ``reason``."""
        for c in req.choices:
            if c.finish_reason is None:
                c.finish_reason = reason
        self._emit(req)

    def _emit(self, req: RouterRequest) -> None:
        now = time.monotonic()
        out = assemble(req, self.stats, now)
        if out.finished:
            tokens = sum(len(c.output_token_ids) for c in req.choices)
            self.placement.finished(req.wire_id, now, tokens)
            self._forget(req)
        req.deliver(out)

    def _forget(self, req: RouterRequest) -> None:
        self.requests.pop(req.request_id, None)
        self.wire.pop(req.wire_id, None)


def _stage_pid(stage: Worker, decode: Worker) -> int:
    """DecodeRequest.stage_pids' entry for one stage: its pid where the decode worker can watch
    it, -1 where it cannot write into the decode worker's memory (it sends frames), else 0."""
    if shm_pairs.shares_pids(stage, decode):
        return stage.pid
    return 0 if shm_pairs.shares_memory(stage, decode) else -1
