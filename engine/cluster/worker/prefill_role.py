"""A prefill worker's role (``engine worker --role prefill``): it runs each request's prompt
with the request's own sampling parameters until every choice has its first token, streams the
prompt's KV to the decode worker the router named (its ``KVSender``, the engine's connector) and
hands the request over with a ``KVDone``; the router streams the first tokens to the client.
In a worker it also copies hot prefix blocks to and from other prefill workers (block_copy.py)
and proves, when the router asks, that it can read a decode worker's shared-memory arena
(shm_proof.py). What every role does for the worker's loop: roles.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import zmq

from engine.cluster import messages as m
from engine.cluster.transfer import shm_proof
from engine.cluster.transfer.seal import prompt_digest
from engine.cluster.transfer.sender import KVSender, SendTarget
from engine.cluster.transfer.staging import KVLayout
from engine.cluster.worker.block_copy import BlockCopier
from engine.cluster.worker.handoff import Captured, capture, first_output
from engine.cluster.worker.roles import (
    Emit,
    Role,
    WorkerSeams,
    engine_priority,
    mooncake_endpoint,
)
from engine.cluster.worker.worker_config import WorkerConfig
from engine.core.llm_engine import LLMEngine
from engine.core.request import Request
from engine.core.scheduler import QueueFullError
from engine.errors import RequestError
from engine.ipc.wire import params_from_wire
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured.compiler import GrammarBusyError

log = logging.getLogger(__name__)


@dataclass
class _Prefill:
    request_id: str
    children: list[Request]
    captured: dict[int, Captured] = field(default_factory=dict)
    num_cached_tokens: int = 0


class KVSenderFactory:
    """A prefill worker's connector factory: its KV sender over the engine's paged cache (a
    stage's own layers of the model's), wrapping ``inner`` (its KV pool's connector, or None).
    The engine calls it once it has built its model and cache, so a failed build leaves no
    endpoint behind."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.mooncake = None
        self.sender: KVSender | None = None

    def __call__(self, cache, inner) -> KVSender:
        self.mooncake = mooncake_endpoint(self.cfg)
        self.sender = KVSender(
            cache.kv,
            cache.block_size,
            inner=inner,
            mooncake=self.mooncake,
            layers=cache.layers,
            model_layers=cache.model_layers,
        )
        return self.sender


class PrefillRole(Role):
    request_type = m.PrefillRequest

    def __init__(self, engine: LLMEngine, sender: KVSender, worker_id: str, emit: Emit) -> None:
        self.engine = engine
        self.sender = sender
        self.worker_id = worker_id
        self.emit = emit
        self.active: dict[str, _Prefill] = {}
        self.last_layer_times: dict[str, float] = {}  # request id -> when its last layer left
        # In a worker (for_worker): its Mooncake endpoint, when that is its transport, and its
        # block copies to and from other prefill workers.
        self.mooncake = None
        self.copier: BlockCopier | None = None

    @classmethod
    def for_worker(cls, cfg: WorkerConfig, seams: WorkerSeams) -> PrefillRole:
        connector = KVSenderFactory(cfg)
        engine = seams.make_engine(cfg.engine, connector)
        role = cls(engine, connector.sender, seams.worker_id, seams.emit)
        role.mooncake = connector.mooncake
        role.copier = BlockCopier(engine, seams.worker_id, seams.emit, seams.ctx, cfg.kv_host)
        return role

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
            self.engine.add_request(
                msg.prompt_token_ids,
                params,
                request_id=rid,
                priority=engine_priority(self.engine, msg.priority),
                **stage_fields,
            )
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

    def control(self, msg: m.Message) -> None:
        if isinstance(msg, m.ShmProbe):  # can this process read that arena's nonce?
            nonce = shm_proof.read_nonce(msg.shm_path)
            self.emit(m.ShmReach(self.worker_id, msg.decode_id, nonce.hex()))
        elif isinstance(msg, m.CopyBlocks) and self.copier is not None:
            self.copier.send(msg)

    # -- in a worker ------------------------------------------------------------------------

    def sockets(self) -> list[zmq.Socket]:
        return [self.copier.sock] if self.copier is not None else []

    def poll(self, readable, now: float) -> None:
        if self.copier is not None and self.copier.sock in readable:
            self.copier.take()

    def registration(self) -> dict:
        return {
            "mooncake_address": self.mooncake.address if self.mooncake is not None else "",
            "copy_address": self.copier.address if self.copier is not None else "",
        }

    def close(self) -> None:
        super().close()
        if self.copier is not None:
            self.copier.close()
