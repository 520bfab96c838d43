"""A decode worker's role (``engine worker --role decode``): it stages the KV a prefill worker
sends (its ``KVReceiver``, the engine's connector, over a staging arena shared with the prefill
workers of its host, TCP or Mooncake), admits each request into its engine once the transfer
ended, going on exactly from the first tokens the client was sent (handoff.py), and streams the
tokens it generates to the router. A transfer that fails is recomputed here or fails the request
(``--kv-load-failure``). What every role does for the worker's loop: roles.py.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass, field

from engine.cluster import messages as m
from engine.cluster.conductor.step_stats import StepStats
from engine.cluster.transfer.receiver import KVReceiver
from engine.cluster.transfer.seal import prompt_digest
from engine.cluster.transfer.staging import StagingArena
from engine.cluster.worker.handoff import admit
from engine.cluster.worker.roles import (
    Emit,
    Role,
    WorkerSeams,
    engine_priority,
    mooncake_endpoint,
)
from engine.cluster.worker.worker_config import WorkerConfig
from engine.core.llm_engine import LLMEngine
from engine.ipc.wire import output_to_wire, params_from_wire
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured.compiler import GrammarBusyError

log = logging.getLogger(__name__)

FAILURE_POLICIES = ("recompute", "fail")
DEADLINE_CHECK_S = 0.1  # how often a worker's loop expires transfers past their deadline


@dataclass
class _Expected:
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int  # the engine's (roles.engine_priority)
    # The first tokens the client was sent, by choice (the router's FirstTokens): what a
    # transfer that fails before its KVDone recomputes from.
    seen: dict[int, dict] = field(default_factory=dict)


def seen_first(o, n: int) -> dict | None:
    """A FirstTokens entry (an ``Outputs`` entry of the prefill worker) as a KVDone ``firsts``
    entry without generator state, or None where it is not a first token of one of n choices."""
    if not isinstance(o, dict):
        return None
    i, ids, text, lps = o.get("index"), o.get("token_ids"), o.get("text"), o.get("logprobs")
    if not (isinstance(i, int) and 0 <= i < n and o.get("offset") == 0 and isinstance(text, str)):
        return None
    if not (isinstance(ids, list) and ids and all(isinstance(t, int) and t >= 0 for t in ids)):
        return None
    lp = lps[0] if isinstance(lps, list) and lps else None
    lp = lp if isinstance(lp, list) and len(lp) == 3 else None  # [token, logprob, top]
    reason = o.get("finish_reason")
    return {"index": i, "token": ids[0], "logprob": lp, "sent_text_len": len(text),
            "finish_reason": reason if isinstance(reason, str) else None,
            "generator": False}  # fmt: skip


class KVReceiverFactory:
    """A decode worker's connector factory: its staging arena (shared memory for the ``shm``
    transport, with the nonce that proves a prefill worker shares it) and its KV receiver over
    the engine's paged cache, wrapping ``inner`` (its KV pool's connector: it saves what it
    generates). The engine calls it once it has built its model and cache, so a failed build
    leaves no arena behind."""

    def __init__(self, cfg: WorkerConfig, wake) -> None:
        self.cfg = cfg
        self.wake = wake
        self.mooncake = None
        self.arena: StagingArena | None = None
        self.arena_nonce = None  # over shm: what proves a prefill worker shares /dev/shm
        self.receiver: KVReceiver | None = None

    def __call__(self, cache, inner) -> KVReceiver:
        cfg = self.cfg
        self.mooncake = mooncake_endpoint(cfg)
        self.arena = StagingArena(cfg.staging_mb << 20, shared=cfg.transport == "shm")
        if self.arena.path:
            from engine.cluster.transfer.shm_proof import ArenaNonce

            self.arena_nonce = ArenaNonce(self.arena.path)
        self.receiver = KVReceiver(
            cache.kv,
            cache.block_size,
            self.arena,
            bind=f"tcp://{cfg.kv_host}:0",
            wake=self.wake,
            remote_writes=cfg.transport in ("shm", "mooncake"),
            local_writers=cfg.transport == "shm",  # Mooncake: a peer's NIC writes
            inner=inner,
        )
        return self.receiver


class DecodeRole(Role):
    request_type = m.DecodeRequest

    def __init__(
        self,
        engine: LLMEngine,
        receiver: KVReceiver,
        worker_id: str,
        emit: Emit,
        policy: str = "recompute",
        deadline_cap_s: float = 600.0,
    ) -> None:
        if policy not in FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure must be one of {FAILURE_POLICIES}, got {policy!r}")
        self.engine = engine
        self.receiver = receiver
        self.worker_id = worker_id
        self.emit = emit
        self.policy = policy
        self.deadline_cap_s = deadline_cap_s
        self.expected: dict[str, _Expected] = {}  # KV arriving, not in the engine yet
        self.running: set[str] = set()  # in the engine
        self.step_stats = StepStats()  # step times, for the router's Conductor
        self._next_check = 0.0  # when the worker's loop next expires transfers
        # In a worker (for_worker): the staging arena, its nonce, the Mooncake endpoint and the
        # arena's base address registered with it.
        self.arena: StagingArena | None = None
        self.arena_nonce = None
        self.mooncake = None
        self.arena_addr = 0

    @classmethod
    def for_worker(cls, cfg: WorkerConfig, seams: WorkerSeams) -> DecodeRole:
        connector = KVReceiverFactory(cfg, seams.wake)
        engine = seams.make_engine(cfg.engine, connector)
        role = cls(engine, connector.receiver, seams.worker_id, seams.emit, cfg.kv_load_failure)
        role.arena, role.arena_nonce = connector.arena, connector.arena_nonce
        role.mooncake = connector.mooncake
        if role.mooncake is not None:
            role.arena_addr = role.mooncake.register(role.arena.buf)
        return role

    def handle(self, msg: m.DecodeRequest) -> None:
        rid = msg.request_id
        try:
            params = params_from_wire(msg.params)
            self.engine.validate(msg.prompt_token_ids, params)
            deadline = min(max(msg.deadline_s, 0.1), self.deadline_cap_s)
            t = self.receiver.expect(
                rid, len(msg.prompt_token_ids), deadline, msg.sender_pid, msg.sender_local,
                msg.senders, msg.stage_pids, prompt_digest(msg.prompt_token_ids),
            )  # fmt: skip
        except (ValueError, TypeError, MemoryError) as exc:
            self.emit(m.DecodeReady(rid, 0, 0, error=str(exc), full=isinstance(exc, MemoryError)))
            return
        priority = engine_priority(self.engine, msg.priority)
        self.expected[rid] = _Expected(list(msg.prompt_token_ids), params, priority)
        self.emit(m.DecodeReady(rid, t.offset, t.layout.nbytes))
        if params.structured_outputs is not None:
            # Compile while the prefill runs: admission then finds it cached (a failure or a
            # busy pool shows there, where admission compiles again).
            try:
                self.engine.grammar_compiler.submit(params.structured_outputs)
            except GrammarBusyError:
                pass

    def control(self, msg: m.Message) -> None:
        if isinstance(msg, m.FirstTokens):
            self.first_tokens(msg)
        elif isinstance(msg, m.SourceGone):
            self.source_gone(msg)

    def first_tokens(self, msg: m.FirstTokens) -> None:
        exp = self.expected.get(msg.request_id)
        if exp is None:
            return  # admitted already (its KVDone carried them) or gone
        for o in msg.outputs:
            first = seen_first(o, exp.params.n)
            if first is not None:
                exp.seen[first["index"]] = first

    def source_gone(self, msg: m.SourceGone) -> None:
        if msg.request_id in self.expected:  # the receiver reports it; on_transfer follows
            self.receiver.fail(msg.request_id, f"prefill worker {msg.worker_id[:64]} died")

    def abort(self, rid: str) -> None:
        if self.expected.pop(rid, None) is not None:
            self.receiver.release(rid)
        if rid in self.running:
            self.running.discard(rid)
            self.engine.abort_request(rid)  # frees blocks; the receiver drops its staging

    def on_transfer(self, rid: str) -> None:
        """The receiver finished rid's transfer (complete, or failed): admit it or apply the
        failure policy."""
        exp = self.expected.pop(rid, None)
        t = self.receiver.get(rid)
        if exp is None or t is None:
            return
        done = t.done
        if t.ok and done is not None and all(f.get("finish_reason") for f in done.firsts):
            self.receiver.release(rid)  # every choice ended at its first token
            return
        if not t.ok:
            log.warning("KV transfer for %s failed: %s", rid, t.error)
            self.emit(m.TransferFailed(rid, t.error or "failed", self.policy == "recompute"))
            if self.policy == "fail":
                self.receiver.release(rid)
                return
        firsts = done.firsts if done is not None else None
        if firsts is None and len(exp.seen) == exp.params.n:
            # No KVDone, but the client has its first tokens: go on from those, not from a
            # token sampled here (unseeded sampling would continue from one it never saw).
            firsts = [exp.seen[i] for i in range(exp.params.n)]
            if all(f["finish_reason"] for f in firsts):
                self.receiver.release(rid)
                return
        try:
            ids = admit(
                self.engine,
                rid,
                exp.prompt_token_ids,
                exp.params,
                firsts,
                [bytes(f) for f in done.frames] if done is not None else [],
                exp.priority,
            )
        except Exception as exc:  # queue full, validation: tell the router
            self.receiver.release(rid)
            self.emit(m.RequestError(rid, self.worker_id, 503, f"decode admission: {exc}"))
            return
        self.receiver.admit(rid, ids if t.ok else [])
        self.running.add(rid)

    def check_deadlines(self) -> None:
        for rid in self.receiver.expire(time.monotonic()):
            self.on_transfer(rid)

    def after_step(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.request_id not in self.running:
                continue
            moved = [
                # "first": the token the choice went on from, which the router checks is the
                # one the client was sent (cluster/transfer/seal.py)
                {**output_to_wire(c, offsets=True), "first": c.token_ids[0] if c.token_ids else -1}
                for c in out.outputs
                if c.new_token_ids or c.new_text or c.finish_reason
            ]
            if out.finished:
                self.running.discard(out.request_id)
            if moved:
                cached = out.metrics.num_cached_tokens if out.metrics else 0
                self.emit(m.Outputs(out.request_id, self.worker_id, moved, cached))

    @property
    def num_requests(self) -> int:
        return len(self.expected) + len(self.running)

    # -- in a worker ------------------------------------------------------------------------

    def poll(self, readable, now: float) -> None:
        """Transfers the receiver ended, and (every DEADLINE_CHECK_S) those past due."""
        while True:
            try:
                rid = self.receiver.events.get_nowait()
            except queue.Empty:
                break
            self.on_transfer(rid)
        if now >= self._next_check:
            self._next_check = now + DEADLINE_CHECK_S
            self.check_deadlines()

    def step(self) -> bool:
        """The engine's step, timed for the Conductor's time-between-tokens model."""
        running = self.engine.scheduler.running
        batch, tokens = len(running), sum(r.num_tokens for r in running)
        t0 = time.perf_counter()
        outputs = self.engine.step()
        if self.engine.last_step_decode_only:  # a recompute's prefill chunks are no TBT
            self.step_stats.add(time.perf_counter() - t0, batch, tokens)
        self.after_step(outputs)
        return False

    def registration(self) -> dict:
        mc = self.mooncake
        return {
            "kv_address": self.receiver.address,
            "shm_path": self.arena.path if self.arena is not None else "",
            "mooncake_address": mc.address if mc is not None else "",
            "arena_addr": self.arena_addr,
            "shm_digest": self.arena_nonce.digest if self.arena_nonce is not None else "",
        }

    def heartbeat(self) -> dict:
        st = self.step_stats.take()
        return {
            "staging_used": self.arena.used if self.arena is not None else 0,
            "steps": st.steps,
            "step_s": st.step_s,
            "step_batch": st.batch,
            "step_tokens": st.tokens,
        }

    def close(self) -> None:
        super().close()
        if self.arena is not None:
            self.arena.close()
        if self.arena_nonce is not None:
            self.arena_nonce.close()
