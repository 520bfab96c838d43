"""A stage of a pipelined prefill group (chunked pipeline parallelism, Mooncake's CPP):
``engine worker --role prefill --group NAME --stage I/N``.

Every stage gets the request's ``PrefillRequest`` from the router and holds the KV of its own
layers in its own paged cache. The first stage embeds the prompt and runs its layers chunk by
chunk (the scheduler's prefill budget is the chunk); after each chunk its hidden states go to the
next stage (``stage_link.py``), which runs its layers on that chunk while the first runs the
next one. The last stage applies the final norm and the LM head, samples the first token and
hands the request over exactly as a prefill worker alone does (``PrefillRole``). Every stage
streams its own layers' KV to the decode worker as they are computed and ends with a ``KVDone``
naming its layer range; the decode worker waits for one from each stage.

Prefix reuse: the first stage reuses at most the prefix the router says every stage holds
(``PrefillRequest.prefix_tokens``) and starts computing at s0; its hidden states start there, so
every later stage must start at exactly s0 too (``prefix_exact``). A stage that no longer holds
it fails the attempt (503), which the router places again.

Failures answer the router with a ``RequestError`` 503 (retried on another prefill unit while the
client has seen nothing): hidden states that do not come by the deadline or come bad, a next
stage that takes nothing, a prefix a stage lacks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from engine.cluster import messages as m
from engine.cluster.transfer.sender import KVSender
from engine.cluster.transfer.staging import KVLayout
from engine.cluster.worker.prefill_role import KVSenderFactory, PrefillRole, _Prefill
from engine.cluster.worker.roles import Emit, WorkerSeams
from engine.cluster.worker.worker_config import WorkerConfig
from engine.core.llm_engine import LLMEngine
from engine.core.output_processor import STAGE_DONE
from engine.core.scheduler_output import ScheduledRequest
from engine.core.stage_io import StageIO, parent_request_id
from engine.errors import RequestError
from engine.ipc.wire import params_from_wire
from engine.pipeline_stage import PipelineStage
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class LinkIO(StageIO):
    """The engine's stage seam over the hidden-state link: inputs from the stage before's
    ``HiddenReceiver``, outputs to the next stage's endpoint through the ``HiddenSender``."""

    def __init__(self, stage: PipelineStage) -> None:
        self.stage = stage
        self.receiver = None  # HiddenReceiver, stages after the first (start())
        self.sender = None  # HiddenSender, stages before the last
        self.next_address: dict[str, str] = {}  # request id -> the next stage's endpoint

    def start(self, ctx, bind: str, hidden_size: int, dtype: torch.dtype, wake) -> None:
        from engine.cluster.worker.hidden_receiver import HiddenReceiver
        from engine.cluster.worker.stage_link import HiddenSender

        if not self.stage.is_first:
            self.receiver = HiddenReceiver(ctx, bind, hidden_size, dtype, wake=wake)
        if not self.stage.is_last:
            self.sender = HiddenSender(ctx, on_fail=wake)

    @property
    def address(self) -> str:
        return self.receiver.address if self.receiver is not None else ""

    def inputs(self, order: Sequence[ScheduledRequest]) -> torch.Tensor:
        assert self.receiver is not None
        parts = []
        for s in order:
            req, start = s.request, s.request.num_computed_tokens
            rid = parent_request_id(req.request_id, req.params.n)
            parts.append(self.receiver.rows(rid, start, start + s.num_tokens))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def outputs(self, order: Sequence[ScheduledRequest], hidden: torch.Tensor) -> None:
        assert self.sender is not None
        row = 0
        for s in order:
            rid = parent_request_id(s.request.request_id, s.request.params.n)
            start = s.request.num_computed_tokens
            address = self.next_address.get(rid)
            if address:
                self.sender.send(rid, address, start, start + s.num_tokens,
                                 hidden[row : row + s.num_tokens])  # fmt: skip
            row += s.num_tokens

    def close(self) -> None:
        for end in (self.receiver, self.sender):
            if end is not None:
                end.close()


@dataclass
class _Waiting:
    """A request on a later stage before the first hidden states came: not in the engine yet."""

    msg: m.PrefillRequest
    params: SamplingParams


class StageRole(PrefillRole):
    """The prefill role of one stage. The last stage is a prefill worker whose inputs are hidden
    states (``PrefillRole`` samples and hands over); earlier ones end a request when its prompt
    went through them."""

    def __init__(
        self,
        engine: LLMEngine,
        sender: KVSender,
        link: LinkIO,
        worker_id: str,
        emit: Emit,
    ) -> None:
        super().__init__(engine, sender, worker_id, emit)
        self.link = link
        self.stage = link.stage
        self.waiting: dict[str, _Waiting] = {}
        self.passing: dict[str, int] = {}  # stages before the last: request id -> prompt tokens
        self.held: set[str] = set()  # requests with hidden-state link state to drop

    @classmethod
    def for_worker(cls, cfg: WorkerConfig, seams: WorkerSeams) -> StageRole:
        """A stage's engine runs its own layers (``cfg.stage``) with the link as its inputs and
        outputs. A stage has no block copier: only a prefill worker alone copies hot prefixes."""
        link = LinkIO(cfg.stage)
        connector = KVSenderFactory(cfg)
        engine = seams.make_engine(replace(cfg.engine, stage=cfg.stage), connector, link)
        link.start(seams.ctx, f"tcp://{cfg.kv_host}:0", engine.model_config.hidden_size,
                   engine.dtype, seams.wake)  # fmt: skip
        role = cls(engine, connector.sender, link, seams.worker_id, seams.emit)
        role.mooncake = connector.mooncake
        return role

    # -- the router's messages --------------------------------------------------------------

    def handle(self, msg: m.PrefillRequest) -> None:
        rid = msg.request_id
        try:
            params = params_from_wire(msg.params)
            if params.prompt_logprobs is not None:
                raise RequestError(
                    "prompt_logprobs are not served by prefill groups", "prompt_logprobs"
                )
            self.engine.validate(msg.prompt_token_ids, params)
            if not self.stage.is_last and not msg.stage_next:
                raise ValueError(f"stage {self.stage} needs the next stage's endpoint")
        except RequestError as exc:
            self.emit(m.RequestError(rid, self.worker_id, 400, exc.message, exc.param))
            return
        except ValueError as exc:  # this stage's set-up, not the request: a 500
            log.error("request %s: %s", rid, exc)
            self.emit(m.RequestError(rid, self.worker_id, 500, str(exc)))
            return
        layout = KVLayout(
            self.sender.num_layers, len(msg.prompt_token_ids), self.sender.token_bytes
        )
        if layout.nbytes != msg.nbytes:
            self.emit(m.RequestError(rid, self.worker_id, 500, "KV layouts differ"))
            return
        self.held.add(rid)
        if msg.stage_next:
            self.link.next_address[rid] = msg.stage_next
        if self.stage.is_first:
            cap = msg.prefix_tokens if msg.prefix_tokens >= 0 else None
            if not self._admit_stage(msg, params, prefix_tokens=cap):
                return
        else:
            try:
                self.link.receiver.expect(rid, len(msg.prompt_token_ids), msg.deadline_s)
            except (ValueError, MemoryError) as exc:
                self._drop(rid)
                self.emit(m.RequestError(rid, self.worker_id, 503, f"stage {self.stage}: {exc}"))
                return
            self.waiting[rid] = _Waiting(msg, params)
            self.on_hidden(rid)  # rows held before the request came may be here already

    def _admit_stage(self, msg: m.PrefillRequest, params: SamplingParams, **stage_fields) -> bool:
        """Into the engine and the KV sender (PrefillRole._admit), with the request fields a
        stage sets. Only the last stage samples: earlier ones take the prompt as one sequence."""
        rid = msg.request_id
        run = params if self.stage.is_last else SamplingParams(max_tokens=1)
        reqs = self._admit(msg, run, **stage_fields)
        if not reqs:
            self._drop(rid)
            return False
        if self.stage.is_last:
            self.active[rid] = _Prefill(rid, reqs)
        else:
            self.passing[rid] = len(msg.prompt_token_ids)
        return True

    def abort(self, rid: str) -> None:
        if self.waiting.pop(rid, None) is not None:
            self._drop(rid)
            return
        if self.passing.pop(rid, None) is not None:
            self.sender.cancel(rid, "aborted")
            self.engine.abort_request(rid)
        else:
            super().abort(rid)
        self._drop(rid)

    def _drop(self, rid: str) -> None:
        """Forget the request's hidden-state link state (both directions)."""
        self.held.discard(rid)
        self.link.next_address.pop(rid, None)
        if self.link.receiver is not None:
            self.link.receiver.release(rid)
        if self.link.sender is not None:
            self.link.sender.forget(rid)

    def _fail(self, rid: str, why: str) -> None:
        log.warning("stage %s: request %s failed: %s", self.stage, rid, why)
        self.abort(rid)
        self.emit(m.RequestError(rid, self.worker_id, 503, f"stage {self.stage}: {why}"))

    # -- the link's news (the worker's loop) ------------------------------------------------

    def on_hidden(self, rid: str) -> None:
        """The stage before's hidden states for rid moved on (rows came, or it failed)."""
        rx = self.link.receiver
        if rx is None:
            return
        err = rx.error(rid)
        if err is not None:
            if rid in self.waiting or rid in self.passing or rid in self.active:
                self._fail(rid, f"hidden states from stage {self.stage.index - 1}: {err}")
            return
        w = self.waiting.get(rid)
        if w is not None:
            start = rx.first_start(rid)
            if start is None:
                return
            del self.waiting[rid]
            if not self._admit_stage(w.msg, w.params, prefix_tokens=start, prefix_exact=True,
                               ready_tokens=rx.ready(rid)):  # fmt: skip
                return
        self.engine.set_ready_tokens(rid, rx.ready(rid))

    def check_link(self, now: float) -> None:
        """Deadlines of hidden states coming, and sends to the next stage that failed."""
        if self.link.receiver is not None:
            for rid in self.link.receiver.expire(now):
                self.on_hidden(rid)
        if self.link.sender is not None:
            for rid, why in self.link.sender.failures():
                if rid in self.passing:
                    self._fail(rid, f"the next stage took nothing: {why}")

    # -- after each engine step -------------------------------------------------------------

    def after_step(self, outputs) -> None:
        if self.stage.is_last:
            for rid, p in list(self.active.items()):  # a prefix this stage lacks, an abort
                ended = [c for c in p.children if c.is_finished and c.num_output_tokens == 0]
                if ended:
                    self._fail(rid, _why_ended(ended[0]))
            super().after_step(outputs)
            for rid in [r for r in self.held if r not in self.active and r not in self.waiting]:
                self._drop(rid)  # handed over: its hidden states are not needed any more
            return
        for out in outputs:
            rid = out.request_id
            if not out.finished or rid not in self.passing:
                continue
            n = self.passing.pop(rid)
            c = out.outputs[0]
            if c.finish_reason != STAGE_DONE:
                self.sender.cancel(rid, "stage failed")
                self._drop(rid)
                self.emit(m.RequestError(rid, self.worker_id, 503,
                                         f"stage {self.stage}: {c.finish_reason} "
                                         f"({c.stop_reason})"))  # fmt: skip
                continue
            cached = out.metrics.num_cached_tokens if out.metrics else 0
            layers = self.sender.layers
            done = m.KVDone(rid, n, self.sender.num_layers, cached, [],
                            layer_start=layers.start, layer_end=layers.stop)  # fmt: skip
            self.sender.finish(rid, done)
            self._drop(rid)

    @property
    def num_requests(self) -> int:
        return len(self.active) + len(self.waiting) + len(self.passing)

    # -- in a worker ------------------------------------------------------------------------

    def poll(self, readable, now: float) -> None:
        """Hidden states that came (or failed), deadlines, failed sends onwards."""
        super().poll(readable, now)
        if self.link.receiver is not None:
            for rid in self.link.receiver.events():
                self.on_hidden(rid)
        self.check_link(now)

    def step(self) -> bool:
        """True when the step ran nothing: the requests wait for the stage before's hidden
        states, and the worker sleeps until they come (the receiver wakes it), not spinning a
        core its peers need."""
        steps = self.engine.num_steps
        super().step()
        return self.engine.num_steps == steps

    def registration(self) -> dict:
        sc = self.engine.scheduler.config  # the group's chunk: its stages' prefill budget
        chunk = sc.long_prefill_token_threshold or sc.max_num_batched_tokens
        return {**super().registration(), "chunk_tokens": chunk,
                "hidden_address": self.link.address}  # fmt: skip

    def heartbeat(self) -> dict:
        rx, tx = self.link.receiver, self.link.sender
        return {
            "staging_used": rx.used_bytes if rx is not None else 0,  # hidden-state rows held
            "hidden_bytes_sent": tx.counters["bytes_sent"] if tx is not None else 0,
        }

    def close(self) -> None:
        super().close()
        self.link.close()


def _why_ended(req) -> str:
    if req.stop_reason == "prefix_missing":
        return "the group's cached prefix is not in this stage's cache any more"
    return f"ended before its first token ({req.finish_reason})"
