"""The engine: requests in, then one step at a time: schedule, run the forward, process the
outputs. Its parts are built by core/engine_setup.py; a step's forward is core/sample_step.py
(or, on a pipeline stage short of the last, core/stage_step.py), chosen once at construction;
what a step produced becomes tokens, stops and outputs in core/output_processor.py.

Not thread-safe: one thread owns it (the embedded LLM, or the loop thread of AsyncLLM).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from engine.config import EngineConfig
from engine.core.connector_calls import layer_hook, save_committed_blocks, save_new_blocks
from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.engine_setup import ConnectorFactory, build_parts, start_device
from engine.core.metrics import EngineMetrics, MetricsSnapshot, StepTimes
from engine.core.output_processor import (
    HANDED_OVER,
    STAGE_DONE,
    FirstToken,
    OutputProcessor,
    Parent,
    StepResult,
)
from engine.core.request import Request
from engine.core.sample_step import SampleStep
from engine.core.sampler import make_generator
from engine.core.scheduler import QueueFullError
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.core.stage_io import StageIO
from engine.core.stage_step import StageInputs, StageStep, no_stage_inputs
from engine.core.step_clock import step_clock
from engine.core.validation import (
    cap_for_tests,
    validate_priority,
    validate_prompt,
    validate_stage_fields,
)
from engine.errors import RequestError
from engine.kvcache.block_pool import BlockListener
from engine.model.llama import LayerHook
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.spec.decoder import SpecDecoder
from engine.structured.grammar import SequenceGrammar

if TYPE_CHECKING:
    from engine.structured.compiler import GrammarCompiler

logger = logging.getLogger("engine")

__all__ = ["HANDED_OVER", "STAGE_DONE", "ConnectorFactory", "FirstToken", "LLMEngine"]


class LLMEngine:
    """``connector_factory`` and ``block_listener`` are the engine's two seams, given at
    construction: the KV connector its scheduler and step loop share (see ConnectorFactory; by
    default the KV pool's connector from ``config.kv_pool``, or none) and the listener the block
    pool tells ("stored" | "removed", block hash) as prefix blocks are named and dropped.

    ``config.stage`` short of the whole model: the engine is one stage of a chunked prefill
    pipeline (engine/pipeline_stage.py). It holds the stage's layers and their KV only, takes its
    input hidden states from and hands its output ones to ``stage_io`` (required then; see
    engine/core/stage_io.py for the protocol) and never runs past a prompt; its connector (a
    cluster stage's KV sender) gets ``save_layer`` calls with global layer indices.
    A stage short of the last finishes a request with finish reason STAGE_DONE once its prompt
    ran; the last stage samples the first token as the whole model does."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        connector_factory: ConnectorFactory | None = None,
        block_listener: BlockListener | None = None,
        stage_io: StageIO | None = None,
    ) -> None:
        config = config or EngineConfig()
        self.stage = config.stage
        if not self.stage.is_whole and stage_io is None:
            raise ValueError(
                f"stage_io is required for pipeline stage {self.stage} (a StageIO: "
                "engine/core/stage_io.py)"
            )
        self.stage_io = stage_io
        parts = self.parts = build_parts(config, connector_factory, block_listener)
        self.config = parts.config  # with this device's scheduler defaults
        self.device, self.dtype = parts.device, parts.dtype
        self.model_config, self.tokenizer = parts.model_config, parts.tokenizer
        self.model_path, self.weight_cache_hit = parts.model_path, parts.weight_cache_hit
        self.model, self.cache, self.kv = parts.model, parts.cache, parts.kv
        self.connector, self.max_model_len = parts.connector, parts.max_model_len
        self.scheduler, self.runner = parts.scheduler, parts.runner
        start_device(parts)
        self.metrics = EngineMetrics()
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids)
        self.out = OutputProcessor(self.scheduler, self.tokenizer, self.eos_token_ids, self.metrics)
        # The step's modes, chosen once: where its input rows come from, and what its forward
        # produces (sampled tokens, or a stage's hidden states for the next stage).
        self._stage_inputs = no_stage_inputs
        if not self.stage.is_first:
            self._stage_inputs = StageInputs(
                stage_io, self.stage, self.model_config.hidden_size, self.dtype, self.device
            )
        self.forward: SampleStep | StageStep
        if self.stage.is_last:
            self.forward = SampleStep(
                self.runner,
                self.model.compute_logits,
                self.model_config.vocab_size,
                self.eos_token_ids,
                self.device,
                self.out.token_text,
            )
        else:
            self.forward = StageStep(self.runner, stage_io, self.device)
        # Speculative decoding (engine/spec/): whole-model engines only (a stage never decodes).
        self.spec: SpecDecoder | None = None
        if self.config.speculative.enabled and self.stage.is_whole:
            self.spec = SpecDecoder(self.config.speculative, self.eos_token_ids)
        self._ids = itertools.count()
        self.layer_hook: LayerHook | None = None
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_compiler_lock = threading.Lock()  # the servers' threads make it too
        self.num_steps = 0
        self.last_step_decode_only = False  # the last step ran one token of each request (step)
        self.step_times = StepTimes()

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles structured-output constraints against this engine's tokenizer (made on first
        use: an engine that never sees a constraint never loads xgrammar). Thread-safe: the
        servers compile on it from their own threads before the loop thread adds the request."""
        if self._grammar_compiler is None:
            with self._grammar_compiler_lock:
                if self._grammar_compiler is None:
                    from engine.structured.compiler import GrammarCompiler

                    self._grammar_compiler = GrammarCompiler(
                        self.tokenizer, self.model_config.vocab_size
                    )
        return self._grammar_compiler

    # -- requests ---------------------------------------------------------------------------

    def validate(
        self, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> None:
        """Raise RequestError naming the field and the limit; changes nothing."""
        validate_prompt(prompt_token_ids, params, self.model_config.vocab_size, self.max_model_len)
        validate_priority(priority, self.scheduler.config.policy)
        if params.prompt_logprobs is not None and not self.stage.is_whole:
            raise RequestError(
                "prompt_logprobs are not served by pipeline stages", "prompt_logprobs"
            )

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        prompt_text: str | None = None,
        ready_tokens: int | None = None,
        prefix_tokens: int | None = None,
        prefix_exact: bool = False,
        priority: int = 0,
    ) -> str:
        """Queue a request (text, or token ids with optional prompt_text for the record).

        ``priority`` (vLLM's): under the scheduling policy "priority", lower values are served
        first and preempted last; under "fcfs" it must be 0 (RequestError naming it).

        Pipeline stages (engine/core/stage_io.py), set on every choice's Request:
        ``ready_tokens``: the prompt tokens whose stage inputs are here (None: all), raised
        later with set_ready_tokens; ``prefix_tokens``: use at most this many tokens of the
        device prefix-cache hit (floored to whole blocks); ``prefix_exact``: start at exactly
        ``prefix_tokens`` cached tokens (a multiple of the block size), or end at admission with
        finish reason "abort", stop reason "prefix_missing" (so too when re-admitted after a
        preemption). A stage short of the last runs one sequence whatever ``params.n`` is."""
        params = params or SamplingParams()
        if not self.stage.is_last and params.n > 1:
            params = dataclasses.replace(params, n=1)  # it never samples: one prompt pass
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise RequestError("prompt token ids must be a list of integers", "prompt")
            text, ids = prompt_text, list(prompt)
        self.validate(ids, params, priority)
        validate_stage_fields(
            len(ids), ready_tokens, prefix_tokens, prefix_exact, self.cache.block_size
        )
        params = cap_for_tests(params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.out.parents:
            raise RequestError(f"request_id {rid!r} is already in use", "request_id")
        # A constraint compiles once (cached): the servers compile it off their event loop
        # before they get here, so this is a cache hit for them.
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammar_compiler.compile(params.structured_outputs)
        room = self.scheduler.config.max_waiting - len(self.scheduler.waiting)
        if params.n > room:  # before building n requests (n = 10**6 took 30 s and GBs)
            raise QueueFullError(
                f"n={params.n} choices do not fit the waiting queue ({room} of "
                f"{self.scheduler.config.max_waiting} places free); retry later"
            )
        children = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            child = Request(
                rid if params.n == 1 else f"{rid}#{i}",
                ids,
                params,
                IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
                prompt=text,
                cache_salt=cache_salt,
                generator=None if seed is None else make_generator(seed, self.device),
                arrival_time=arrival_time,
                priority=priority,
            )
            if grammar is not None:
                child.grammar = SequenceGrammar(grammar)
            if i > 0:
                child.prompt_logprobs = None  # one child computes them for all (same prompt)
            child.ready_tokens = ready_tokens
            child.prefix_tokens = prefix_tokens
            child.prefix_exact = prefix_exact
            children.append(child)
        added = []
        try:
            for child in children:
                self.scheduler.add_request(child)
                added.append(child)
        except Exception:
            for child in added:
                self.scheduler.finish(child, "abort")
            raise
        self.out.parents[rid] = Parent(rid, text, ids, children)
        with self.metrics.lock:
            self.metrics.prompt_tokens += len(ids) * params.n
        return rid

    def add_prefilled(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        firsts: Sequence[FirstToken],
        priority: int = 0,
    ) -> list[str]:
        """Join a request whose prompt another engine prefilled and whose choices sampled their
        first tokens there: each choice goes on from its first token as if sampled here (stop
        checks, detokenizer, logprobs, the generator's position); its prompt KV comes from the
        connector (or is recomputed). Returns the ids of the choices that still generate."""
        if len(firsts) != params.n:
            raise ValueError(
                f"firsts must hold one token per choice (n={params.n}), got {len(firsts)}"
            )
        rid = self.add_request(prompt_token_ids, params, request_id=request_id, priority=priority)
        now = time.monotonic()
        live = []
        parent = self.out.parents[rid]
        for req, first in zip(parent.children, firsts):
            if first.generator_state is not None and req.generator is not None:
                state = torch.frombuffer(bytearray(first.generator_state), dtype=torch.uint8)
                req.generator.set_state(state)
            self.out.append(req, first.token, first.logprob, now)
            req.sent_text_len, req.sent_tokens = first.sent_text_len, 1
            if not req.is_finished:
                live.append(req.request_id)
        if not live:  # every choice ended at its first token (a stop, or one its grammar refused)
            self.out.end(parent)
        return live

    def set_ready_tokens(self, request_id: str, ready_tokens: int) -> bool:
        """A pipeline stage's request has its inputs for its first ``ready_tokens`` prompt
        tokens now (every choice). Call between steps; False for an unknown id."""
        parent = self.out.parents.get(request_id)
        if parent is None:
            return False
        validate_stage_fields(
            len(parent.prompt_token_ids), ready_tokens, None, False, self.cache.block_size
        )
        for child in parent.children:
            child.ready_tokens = ready_tokens
        return True

    def requests_of(self, request_id: str) -> list[Request]:
        """The engine requests (one per choice) of a request in flight; [] once it ended."""
        parent = self.out.parents.get(request_id)
        return list(parent.children) if parent is not None else []

    def hand_over(self, request_id: str) -> bool:
        """The choices that sampled their first token go on in another engine: they stop here
        with finish reason ``handed_over`` (counted as such, not as aborts) and free their
        blocks. Once every choice ended, the request is gone. False for an unknown id."""
        parent = self.out.parents.get(request_id)
        if parent is None:
            return False
        for child in parent.children:
            if not child.is_finished and child.num_output_tokens >= 1:
                self.out.finish(child, HANDED_OVER)
        if all(c.is_finished for c in parent.children):
            self.out.end(parent)
        return True

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks. Unknown or finished ids are a no-op."""
        parent = self.out.parents.get(request_id)
        if parent is None:
            return False
        for child in parent.children:
            if not child.is_finished:
                self.out.finish(child, "abort")
        self.out.end(parent)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.out.parents) or bool(self.out.pending)

    # -- one step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample, and return the outputs of requests that moved."""
        outputs = self.out.take_pending()
        t0 = time.perf_counter()
        if self.spec is not None:
            self.spec.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        # One token of each request's own (and its drafts): a decode step, not a prefill chunk.
        self.last_step_decode_only = bool(sched.scheduled) and all(
            s.num_real_tokens == 1 for s in sched.scheduled
        )
        outputs += self.out.ended(sched.ended)  # a stage's prefix_exact request with no prefix
        if sched.empty:
            if self.scheduler.loading and not outputs:
                self.connector.wait(0.01)  # only loads in flight: do not spin
            return outputs
        self.out.note_scheduled(sched.scheduled, time.monotonic())
        inputs = self.runner.prepare(sched.scheduled, self.kv.block_tables)
        t1 = step_clock(self.device)
        hook = layer_hook(self.connector, self.layer_hook, inputs, self.kv)
        ran = self.forward.run(inputs, hook, self._stage_inputs(inputs.order))
        self._advance(sched, ran)
        outputs += self.out.deliver(ran, time.monotonic())
        if self.spec is not None:
            self._commit_drafts(ran)
        t2, t3 = ran.forward_done, ran.sampled_done
        self.step_times.add(t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)
        return outputs

    def _advance(self, sched: SchedulerOutput, ran: StepResult) -> None:
        """After the forward: the prompt tokens it computed, the scheduler's counts, the blocks
        it filled handed to the connector."""
        computed = 0
        for s in sched.scheduled:
            req = s.request
            start = req.num_computed_tokens
            prompt_part = max(0, min(start + s.num_tokens, req.num_prompt_tokens) - start)
            req.metrics.num_computed_prompt_tokens += prompt_part
            computed += prompt_part
        with self.metrics.lock:
            self.metrics.computed_prompt_tokens += computed
        self.scheduler.update_after_step(sched)
        if self.connector is not None and ran.tokens is not None:  # (a stage sent its layers)
            save_new_blocks(self.connector, self.kv, sched)
        self.num_steps += 1

    def _commit_drafts(self, ran: StepResult) -> None:
        """After a step's tokens were appended: the kept drafts' KV joins the computed prefix
        (its full blocks named and handed to the connector), the proposer and each sequence's
        draft budget learn what was kept, and requests that ended feed the proposer."""
        assert self.spec is not None
        for req, proposed, kept in ran.drafts:
            self.spec.observe(req, proposed, kept)
            if req.is_finished:
                continue
            before = req.num_computed_tokens
            self.scheduler.commit_drafts(req)
            if self.connector is not None:
                save_committed_blocks(self.connector, self.kv, req, before)
        for req in dict.fromkeys(ran.requests):
            if req.is_finished and req.finish_reason in ("stop", "length"):
                self.spec.finished(req)

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int], chunk_size: int | None = None) -> torch.Tensor:
        """float32 logits at every position of ``token_ids`` [T, V], computed through the paged
        cache in chunks of ``chunk_size`` tokens (all at once by default). For tests and prompt
        logprobs; runs outside the scheduler, so call it only while the engine is idle. Only on
        the whole model (ValueError on a pipeline stage)."""
        if not self.stage.is_whole:
            raise ValueError(f"prompt_logits needs the whole model, not stage {self.stage}")
        self.validate(token_ids, SamplingParams(max_tokens=1))
        req = Request(f"logits-{next(self._ids)}", token_ids, SamplingParams(), None)
        chunk = chunk_size or len(token_ids)
        parts = []
        try:
            while req.num_computed_tokens < len(token_ids):
                n = min(chunk, len(token_ids) - req.num_computed_tokens)
                if not self.kv.allocate(req, n):
                    raise MemoryError("not enough free KV blocks for prompt_logits")
                step = [ScheduledRequest(req, n)]
                inputs = self.runner.prepare(step, self.kv.block_tables)
                parts.append(self.runner.execute(inputs, all_logits=True))
                req.num_computed_tokens += n
        finally:
            self.kv.free(req)
        return torch.cat(parts)

    # -- introspection ----------------------------------------------------------------------

    def metrics_snapshot(self) -> MetricsSnapshot:
        return self.metrics.snapshot(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=self.kv.usage(),
            num_blocks=self.kv.num_blocks,
            prefix_queries=self.kv.prefix_queries,
            prefix_hits=self.kv.prefix_hits,
            preemptions=self.scheduler.num_preemptions,
            kv_pool=self.connector.stats() if self.connector is not None else None,
            spec=self.spec.stats.snapshot() if self.spec is not None else None,
        )

    def check_integrity(self) -> None:
        self.kv.check_integrity()

    def reset_prefix_cache(self) -> int:
        """Forget the device cache's unreferenced prefix blocks (those of running requests stay);
        returns how many. The KV pool is left alone."""
        return self.kv.pool.evict_all_cached()

    def close(self) -> None:
        """Release the KV connector's threads, shared memory and sockets. Idempotent."""
        if self.connector is not None:
            self.connector.close()
        if self._grammar_compiler is not None:
            self._grammar_compiler.close()

    def run_until_done(self, show_progress: bool = False, total: int | None = None):
        """Step until every request finished; yields each step's outputs."""
        bar = tqdm(total=total, disable=not show_progress, desc="generate", unit="req")
        try:
            while self.has_unfinished_requests():
                outs = self.step()
                bar.update(sum(1 for o in outs if o.finished))
                yield outs
        finally:
            bar.close()
