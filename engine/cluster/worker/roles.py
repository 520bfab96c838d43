"""What a prefill and a decode worker do with their engine, apart from sockets (worker.py).

Each role takes router messages, steps nothing itself, and hands messages for the router to
``emit``; the worker's loop owns the sockets and the engine's step. Tests drive the roles in one
process to check the KV path without process plumbing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.cluster import messages as m
from engine.cluster.worker.handoff import Captured, admit, capture, first_output
from engine.core.llm_engine import LLMEngine
from engine.core.request import Request
from engine.core.scheduler import QueueFullError
from engine.errors import RequestError
from engine.ipc.wire import output_to_wire, params_from_wire
from engine.kv_connector.receiver import KVReceiver
from engine.kv_connector.seal import prompt_digest
from engine.kv_connector.sender import KVSender, SendTarget
from engine.kv_connector.staging import KVLayout
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured.compiler import GrammarBusyError

log = logging.getLogger(__name__)

Emit = Callable[[m.Message], None]
FAILURE_POLICIES = ("recompute", "fail")


@dataclass
class _Prefill:
    request_id: str
    children: list[Request]
    captured: dict[int, Captured] = field(default_factory=dict)
    num_cached_tokens: int = 0


class PrefillRole:
    def __init__(self, engine: LLMEngine, sender: KVSender, worker_id: str, emit: Emit) -> None:
        self.engine = engine
        self.sender = sender
        self.worker_id = worker_id
        self.emit = emit
        self.active: dict[str, _Prefill] = {}
        self.last_layer_times: dict[str, float] = {}  # request id -> when its last layer left

    def handle(self, msg: m.PrefillRequest) -> None:
        try:
            params = params_from_wire(msg.params)
        except RequestError as exc:
            self.emit(m.RequestError(msg.request_id, self.worker_id, 400, exc.message, exc.param))
            return
        reqs = self._admit(msg, params)
        if reqs:
            self.active[msg.request_id] = _Prefill(msg.request_id, reqs)

    def _admit(self, msg: m.PrefillRequest, params: SamplingParams, **stage_fields) -> list:
        """The request into the engine (a pipeline stage's request fields with it) and its KV
        into the sender: its engine requests, or [] after telling the router why not."""
        rid = msg.request_id
        layout = KVLayout(
            self.sender.num_layers, len(msg.prompt_token_ids), self.sender.token_bytes
        )
        if layout.nbytes != msg.nbytes:
            self.emit(m.RequestError(rid, self.worker_id, 500, "KV layouts differ"))
            return []
        try:
            self.engine.add_request(msg.prompt_token_ids, params, request_id=rid, **stage_fields)
        except QueueFullError as exc:
            self.emit(m.RequestError(rid, self.worker_id, 429, str(exc)))
            return []
        except GrammarBusyError as exc:  # too many structured-output compiles in flight
            self.emit(m.RequestError(rid, self.worker_id, 503, str(exc)))
            return []
        except RequestError as exc:
            self.emit(m.RequestError(rid, self.worker_id, 400, exc.message, exc.param))
            return []
        except Exception as exc:  # not the request's fault: a 500, and the worker goes on
            log.exception("request %s: internal error", rid)
            self.emit(m.RequestError(rid, self.worker_id, 500, f"internal error: {exc!r}"))
            return []
        reqs = self.engine.requests_of(rid)
        self.sender.add(
            SendTarget(
                rid,
                reqs[0].request_id,
                msg.kv_address,
                msg.transport,
                msg.shm_path,
                msg.offset,
                layout,
                stream_layers=msg.stream_layers,
                peer_address=msg.peer_address,
                peer_base=msg.peer_base,
                prompt_digest=prompt_digest(msg.prompt_token_ids),
            )
        )
        return reqs

    def abort(self, rid: str) -> None:
        if self.active.pop(rid, None) is not None:
            self.sender.cancel(rid, "aborted")
            self.engine.abort_request(rid)

    def after_step(self, outputs: list[RequestOutput]) -> None:
        """Capture first tokens; hand over the requests whose every choice has one."""
        del outputs  # the prefill side streams nothing itself; the requests' state is read
        for rid, p in list(self.active.items()):
            captured = False
            for i, req in enumerate(p.children):
                if i in p.captured:
                    continue
                if req.num_output_tokens >= 1:
                    p.captured[i] = capture(i, req)
                    p.num_cached_tokens = max(p.num_cached_tokens, req.metrics.num_cached_tokens)
                    captured = True
                elif req.is_finished:  # aborted or failed before a token: give up
                    self.abort(rid)
                    self.emit(m.RequestError(rid, self.worker_id, 500, "prefill failed"))
                    break
            else:
                # Their KV left already: they must not decode on here. Only once every choice
                # that has its first token is captured: hand_over ends them all, and a choice
                # captured after it would carry the finish reason "handed_over" to the client.
                if captured:
                    self.engine.hand_over(rid)
                if len(p.captured) == len(p.children):
                    self._hand_over(p)

    def _hand_over(self, p: _Prefill) -> None:
        del self.active[p.request_id]
        caps = [p.captured[i] for i in range(len(p.children))]
        states = tuple(c.generator_state for c in caps if c.generator_state is not None)
        done = m.KVDone(
            p.request_id,
            p.children[0].num_prompt_tokens,
            self.sender.num_layers,
            p.num_cached_tokens,
            [c.first for c in caps],
            frames=states,
            layer_start=self.sender.layers.start,  # all of them, but a pipeline stage's
            layer_end=self.sender.layers.stop,
        )
        t = self.sender.finish(p.request_id, done)
        if t:
            self.last_layer_times[p.request_id] = t
        self.emit(
            m.Outputs(
                p.request_id,
                self.worker_id,
                [first_output(c.first) for c in caps],
                num_cached_tokens=p.num_cached_tokens,
            )
        )

    @property
    def num_requests(self) -> int:
        return len(self.active)


@dataclass
class _Expected:
    prompt_token_ids: list[int]
    params: SamplingParams
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


class DecodeRole:
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
            self.emit(m.DecodeReady(rid, 0, 0, error=str(exc)))
            return
        self.expected[rid] = _Expected(list(msg.prompt_token_ids), params)
        self.emit(m.DecodeReady(rid, t.offset, t.layout.nbytes))
        if params.structured_outputs is not None:
            # Compile while the prefill runs: admission then finds it cached (a failure or a
            # busy pool shows there, where admission compiles again).
            try:
                self.engine.grammar_compiler.submit(params.structured_outputs)
            except GrammarBusyError:
                pass

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
                # one the client was sent (kv_connector/seal.py)
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
