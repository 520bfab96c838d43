"""The engine: tokenizer, model, paged cache, scheduler and sampler, advanced one step at a time.

Not thread-safe: one thread owns it (the embedded LLM, or the loop thread of AsyncLLM).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from tqdm import tqdm

from engine import cpu_isa, envs
from engine.config import EngineConfig, ModelConfig
from engine.core.cache_plan import plan_cache
from engine.core.connector_calls import layer_hook, save_new_blocks
from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.device_memory import MemoryBaseline, select_device
from engine.core.metrics import EngineMetrics, MetricsSnapshot, StepTimes
from engine.core.model_runner import ModelRunner, StepInputs
from engine.core.output_builder import build_output
from engine.core.prompt_logprobs import fill_prompt_logprobs, rows_wanted
from engine.core.request import Request
from engine.core.sampler import Sampler, SamplingBatch, make_generator
from engine.core.scheduler import QueueFullError, Scheduler
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.core.stage_io import StageIO
from engine.core.stop_conditions import StopResult, check_stop, safe_text_len
from engine.core.validation import cap_for_tests, validate_prompt
from engine.errors import RequestError
from engine.kernels.variants import ModelShape
from engine.kv_connector.base import KVConnector
from engine.kvcache.block_pool import BlockListener
from engine.kvcache.kv_cache_manager import KVCacheManager
from engine.kvcache.paged_cache import PagedKVCache
from engine.model.builder import build_model
from engine.model.llama import LayerHook
from engine.outputs import RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.structured.grammar import SequenceGrammar, step_bitmask

if TYPE_CHECKING:
    from engine.structured.compiler import GrammarCompiler

logger = logging.getLogger("engine")

HANDED_OVER = "handed_over"  # finish reason of a choice that goes on in another engine
STAGE_DONE = "stage_done"  # finish reason on a pipeline stage short of the last: prompt ran

ConnectorFactory = Callable[[PagedKVCache, KVConnector | None], KVConnector]
"""Builds the connector an engine uses from its paged cache (``cache.kv``, ``cache.block_size``)
and ``inner``, the KV-pool connector the engine built from ``config.kv_pool`` (None without a
pool), which the connector it returns wraps or replaces (a cluster worker's KV sender/receiver)."""


class FirstToken(NamedTuple):
    """A choice's first token, sampled by another engine that prefilled the prompt (a prefill
    worker), and the state that continues it here exactly as if this engine had sampled it."""

    token: int
    logprob: TokenLogprob | None = None
    sent_text_len: int = 0  # characters of its text the client has seen already
    generator_state: bytes | None = None  # the seeded generator's state after sampling it


@dataclass
class _Parent:
    """A user request; n > 1 fans out into n child sequences that share the prompt's KV blocks."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]


class LLMEngine:
    """``connector_factory`` and ``block_listener`` are the engine's two seams, given at
    construction: the KV connector its scheduler and step loop share (see ConnectorFactory; by
    default the KV pool's connector from ``config.kv_pool``, or none) and the listener the block
    pool tells ("stored" | "removed", block hash) as prefix blocks are named and dropped.

    ``config.stage`` short of the whole model: the engine is one stage of a chunked prefill
    pipeline (engine/model/stages.py). It holds the stage's layers and their KV only, takes its
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
        self.config = config
        self.stage = config.stage
        if not self.stage.is_whole:
            if stage_io is None:
                raise ValueError(
                    f"stage_io is required for pipeline stage {self.stage} (a StageIO: "
                    "engine/core/stage_io.py)"
                )
        self.stage_io = stage_io
        cap = envs.test_max_tokens()  # a bad value fails here, at start-up
        if cap is not None:
            logger.warning(
                "ENGINE_TEST_MAX_TOKENS=%d: every request's max_tokens is capped at %d "
                "(a test-only setting)",
                cap,
                cap,
            )
        # The GPU current first (Triton launches on it), its memory before the weights load.
        self.device = select_device(config.resolved_device())
        # The step's token budget: the user's, else this device's default (config.py).
        self._budget_set = config.scheduler.max_num_batched_tokens is not None
        scheduler = config.scheduler.for_device(self.device.type)
        config = dataclasses.replace(config, scheduler=scheduler)
        self.config = config
        baseline = MemoryBaseline.take(self.device)
        self.dtype = config.resolved_dtype()
        torch.manual_seed(config.seed)
        built = build_model(
            config.model,
            self.dtype,
            self.device,
            show_progress=config.show_progress,
            use_cache=config.weight_cache,
            stage=config.stage,
        )
        self.model_config = built.config
        self.tokenizer = built.tokenizer
        self.model_path = built.path
        self.weight_cache_hit = built.cache_hit
        model = self.model = built.model
        del built
        # The weights as they will be held (int8, or 16-bit under float32 activations) before
        # the KV pool binds: its namespace hashes them, so KV of other weights never loads.
        if config.quantization == "int8":
            model.quantize_int8_()
        model.store_weights_(config.resolved_weight_dtype())
        layers = len(model.layers)  # a stage's cache holds its own layers only
        plan = plan_cache(config, self.model_config, self.dtype, self.device, baseline, layers)
        cc, num_blocks = plan.cache, plan.num_blocks
        self.cache = PagedKVCache(
            self.model_config,
            num_blocks,
            cc.block_size,
            self.dtype,
            self.device,
            layers,
            first_layer=model.layer_range.start,
        )
        self.kv = KVCacheManager(
            num_blocks, cc.block_size, cc.enable_prefix_caching, listener=block_listener
        )
        self.connector: KVConnector | None = None
        if config.kv_pool:
            from engine.kv_connector.factory import make_pool_connector

            self.connector = make_pool_connector(
                config.kv_pool, self.model_config, model, self.cache, self.device
            )
        if connector_factory is not None:
            self.connector = connector_factory(self.cache, self.connector)
        self.max_model_len = plan.max_model_len
        self.scheduler = Scheduler(
            config.scheduler, self.kv, self.connector, prefill_only=not self.stage.is_whole
        )
        self.runner = ModelRunner(
            model,
            self.cache,
            self.device,
            quantization=config.quantization,
            compile=config.resolved_compile(),
            pack_weights=config.pack_weights,
        )
        if self.device.type == "cpu":
            self._log_cpu()
        elif self.device.type == "cuda":
            self._prepare_gpu()
        self.sampler = Sampler()
        self.metrics = EngineMetrics()
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids)
        self._parents: dict[str, _Parent] = {}
        self._pending: list[RequestOutput] = []
        self._ids = itertools.count()
        self._token_texts: dict[int, str] = {}
        self.layer_hook: LayerHook | None = None
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_compiler_lock = threading.Lock()  # the servers' threads make it too
        self.num_steps = 0
        self.step_times = StepTimes()

    def _prepare_gpu(self) -> None:
        """Before serving on CUDA: compile every Triton kernel variant this engine's shapes need
        (kernels/variants.py), then capture the decode CUDA graphs unless told not to."""
        from engine.core.cuda_graphs import CudaGraphBackend
        from engine.kernels.variants import warm_up

        shape = kernel_shape(self.model_config, self.config.quantization == "int8")
        count, seconds = warm_up(shape, self.cache.block_size, self.dtype, self.device)
        logger.info("warm-up: %d Triton kernel variants compiled in %.1f s", count, seconds)
        if self.config.enforce_eager:
            logger.info("CUDA graphs off (enforce_eager): decode steps run eagerly")
        elif not self.stage.is_whole:
            logger.info("CUDA graphs off on pipeline stage %s: stages only prefill", self.stage)
        elif self.runner.compiled:
            logger.info("CUDA graphs off under compile: decode steps run eagerly")
        else:
            self.runner.enable_graphs(
                self.config.scheduler.max_num_seqs,
                self.max_model_len,
                CudaGraphBackend(self.device),
            )

    def _log_cpu(self) -> None:
        """One line on the CPU (engine/cpu_isa.py) and what this engine runs on it; a warning
        where its 16-bit dtype is not native to the CPU and so runs slower than float32."""
        isa = cpu_isa.this_cpu()
        dtype = str(self.dtype).removeprefix("torch.")
        on = {True: "on", False: "off"}
        weights = self.config.quantization or str(self.model.weight_dtype).removeprefix("torch.")
        logger.info(
            "%s; this engine: %s%s (%s), packed bf16 weights %s, C decoder layers %s, "
            "%d tokens per step (%s)",
            isa.describe(),
            dtype,
            f" with {weights} weights" if weights != dtype else "",
            self.config.dtype_reason(),
            on[bool(self.runner.packed)],
            on[bool(self.runner.native_decode)],
            self.scheduler.config.max_num_batched_tokens,
            "--max-num-batched-tokens" if self._budget_set else "the CPU default",
        )
        note = isa.slow_dtype_note(dtype)
        if note:
            logger.warning(note)

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

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError naming the field and the limit; changes nothing."""
        validate_prompt(prompt_token_ids, params, self.model_config.vocab_size, self.max_model_len)
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
    ) -> str:
        """Queue a request (text, or token ids with optional prompt_text for the record).

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
        self.validate(ids, params)
        self._validate_stage_fields(len(ids), ready_tokens, prefix_tokens, prefix_exact)
        params = cap_for_tests(params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self._parents:
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
        self._parents[rid] = _Parent(rid, text, ids, children)
        with self.metrics.lock:
            self.metrics.prompt_tokens += len(ids) * params.n
        return rid

    def add_prefilled(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        firsts: Sequence[FirstToken],
    ) -> list[str]:
        """Join a request whose prompt another engine prefilled and whose choices sampled their
        first tokens there: each choice goes on from its first token as if sampled here (stop
        checks, detokenizer, logprobs, the generator's position); its prompt KV comes from the
        connector (or is recomputed). Returns the ids of the choices that still generate."""
        if len(firsts) != params.n:
            raise ValueError(
                f"firsts must hold one token per choice (n={params.n}), got {len(firsts)}"
            )
        rid = self.add_request(prompt_token_ids, params, request_id=request_id)
        now = time.monotonic()
        live = []
        for req, first in zip(self._parents[rid].children, firsts):
            if first.generator_state is not None and req.generator is not None:
                state = torch.frombuffer(bytearray(first.generator_state), dtype=torch.uint8)
                req.generator.set_state(state)
            self._append(req, first.token, first.logprob, now)
            req.sent_text_len, req.sent_tokens = first.sent_text_len, 1
            if not req.is_finished:
                live.append(req.request_id)
        if not live:  # every choice ended at its first token (a stop, or one its grammar refused)
            parent = self._parents.pop(rid)
            self._pending.append(self._make_output(parent, final=True))
        return live

    def _validate_stage_fields(
        self, num_prompt: int, ready: int | None, prefix: int | None, exact: bool
    ) -> None:
        for name, value in (("ready_tokens", ready), ("prefix_tokens", prefix)):
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value < 0
            ):
                raise ValueError(f"{name} must be None or an int >= 0, got {value!r}")
        if ready is not None and ready > num_prompt:
            raise ValueError(f"ready_tokens ({ready}) must be <= the prompt's {num_prompt} tokens")
        if exact:
            bs = self.cache.block_size
            if prefix is None or prefix % bs or prefix >= num_prompt:
                raise ValueError(
                    "prefix_exact needs prefix_tokens, a multiple of the block size "
                    f"({bs}) shorter than the prompt ({num_prompt} tokens), got {prefix!r}"
                )

    def set_ready_tokens(self, request_id: str, ready_tokens: int) -> bool:
        """A pipeline stage's request has its inputs for its first ``ready_tokens`` prompt
        tokens now (every choice). Call between steps; False for an unknown id."""
        parent = self._parents.get(request_id)
        if parent is None:
            return False
        self._validate_stage_fields(len(parent.prompt_token_ids), ready_tokens, None, False)
        for child in parent.children:
            child.ready_tokens = ready_tokens
        return True

    def requests_of(self, request_id: str) -> list[Request]:
        """The engine requests (one per choice) of a request in flight; [] once it ended."""
        parent = self._parents.get(request_id)
        return list(parent.children) if parent is not None else []

    def hand_over(self, request_id: str) -> bool:
        """The choices that sampled their first token go on in another engine: they stop here
        with finish reason ``handed_over`` (counted as such, not as aborts) and free their
        blocks. Once every choice ended, the request is gone. False for an unknown id."""
        parent = self._parents.get(request_id)
        if parent is None:
            return False
        for child in parent.children:
            if not child.is_finished and child.num_output_tokens >= 1:
                self.scheduler.finish(child, HANDED_OVER)
                self._count_finished(child)
        if all(c.is_finished for c in parent.children):
            self._pending.append(self._make_output(parent, final=True))
            del self._parents[request_id]
        return True

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks. Unknown or finished ids are a no-op."""
        parent = self._parents.get(request_id)
        if parent is None:
            return False
        for child in parent.children:
            if not child.is_finished:
                self.scheduler.finish(child, "abort")
                self._count_finished(child)
        self._pending.append(self._make_output(parent, final=True))
        del self._parents[request_id]
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents) or bool(self._pending)

    # -- one step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward, sample, and return the outputs of requests that moved."""
        outputs, self._pending = self._pending, []
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.ended:  # a stage's prefix_exact request whose prefix was missing
            for req in sched.ended:
                self._count_finished(req)
            outputs.extend(self._outputs_of(sched.ended))
        if sched.empty:
            if self.scheduler.loading and not outputs:
                self.connector.wait(0.01)  # only loads in flight: do not spin
            return outputs
        now = time.monotonic()
        for s in sched.scheduled:
            m = s.request.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
                with self.metrics.lock:
                    self.metrics.queue_time.observe(now - m.arrival_time)
        inputs = self.runner.prepare(sched.scheduled, self.kv.block_tables)
        t1 = step_clock(self.device)
        hidden_in = None if self.stage.is_first else self._stage_inputs(inputs.order)
        hook = layer_hook(self.connector, self.layer_hook, inputs, self.kv)
        if not self.stage.is_last:
            return outputs + self._stage_step(sched, inputs, hook, hidden_in, t0, t1)
        wanted = rows_wanted(inputs.order, [s.num_tokens for s in inputs.order])
        if wanted:
            step = self.runner.execute_with_hidden(inputs, hook, hidden=hidden_in)
            logits = step.logits
            fill_prompt_logprobs(wanted, step.hidden, self.model.compute_logits, self._token_text)
            del step
        else:
            logits = self.runner.execute(inputs, hook, hidden=hidden_in)
        del hidden_in
        t2 = step_clock(self.device)
        sampling = [s.request for s in inputs.order if s.samples]
        grammars = [r.grammar for r in sampling]
        bitmask = None
        if any(g is not None for g in grammars):
            bitmask = step_bitmask(grammars, self.model_config.vocab_size)
        batch = SamplingBatch.build(
            [r.params for r in sampling],
            [r.generator for r in sampling],
            [r.prompt_token_ids for r in sampling],
            [r.output_token_ids for r in sampling],
            self.model_config.vocab_size,
            self.device,
            eos_token_ids=self.eos_token_ids,
            bitmask=bitmask,
        )
        sampled = self.sampler(logits, batch)  # its .tolist() waits for the device
        t3 = time.perf_counter()
        self._account_computed(sched)
        self.scheduler.update_after_step(sched)
        if self.connector is not None:
            save_new_blocks(self.connector, self.kv, sched)
        self.num_steps += 1
        now = time.monotonic()
        for req, token, lp in zip(sampling, sampled.token_ids, sampled.logprobs):
            self._append(req, token, lp, now)
        outputs.extend(self._outputs_of(sampling))
        self.step_times.add(t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)
        return outputs

    def _outputs_of(self, moved: Sequence[Request]) -> list[RequestOutput]:
        """The outputs of the requests whose choices in ``moved`` moved (or ended), each once;
        a request whose choices all ended gives its final output and is gone."""
        parents: dict[str, _Parent] = {}
        for req in moved:
            parent = self._parents.get(_parent_id(req))
            if parent is not None:
                parents[parent.request_id] = parent
        outputs = []
        for parent in parents.values():
            done = all(c.is_finished for c in parent.children)
            outputs.append(self._make_output(parent, final=done))
            if done:
                del self._parents[parent.request_id]
        return outputs

    def _stage_inputs(self, order: Sequence[ScheduledRequest]) -> torch.Tensor:
        """A later pipeline stage's input rows from its StageIO, checked against the step."""
        assert self.stage_io is not None
        hidden = self.stage_io.inputs(order)
        rows = sum(s.num_tokens for s in order)
        want = (rows, self.model_config.hidden_size)
        if tuple(hidden.shape) != want or hidden.dtype != self.dtype:
            raise RuntimeError(
                f"StageIO.inputs gave {tuple(hidden.shape)} {hidden.dtype} hidden states, the "
                f"step of stage {self.stage} needs {want} {self.dtype}"
            )
        return hidden.to(self.device)

    def _stage_step(
        self,
        sched: SchedulerOutput,
        inputs: StepInputs,
        hook: LayerHook | None,
        hidden_in: torch.Tensor | None,
        t0: float,
        t1: float,
    ) -> list[RequestOutput]:
        """The rest of a step on a pipeline stage short of the last: no logits, no sampling;
        the hidden states go to the StageIO, and the requests whose prompt ran end STAGE_DONE
        (their full blocks stay in the prefix cache)."""
        assert self.stage_io is not None
        hidden = self.runner.execute_hidden(inputs, hook, hidden_in)
        del hidden_in
        self.stage_io.outputs(inputs.order, hidden)
        del hidden
        t2 = step_clock(self.device)
        done = [s.request for s in inputs.order if s.samples]  # before the counts advance
        self._account_computed(sched)
        self.scheduler.update_after_step(sched)
        self.num_steps += 1
        for req in done:
            self.scheduler.finish(req, STAGE_DONE)
            self._count_finished(req)
        outputs = self._outputs_of(done)
        self.step_times.add(t1 - t0, t2 - t1, 0.0, time.perf_counter() - t2)
        return outputs

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)  # bounded by the vocabulary
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    def _account_computed(self, sched: SchedulerOutput) -> None:
        computed = 0
        for s in sched.scheduled:
            req = s.request
            start = req.num_computed_tokens
            prompt_part = max(0, min(start + s.num_tokens, req.num_prompt_tokens) - start)
            req.metrics.num_computed_prompt_tokens += prompt_part
            computed += prompt_part
        with self.metrics.lock:
            self.metrics.computed_prompt_tokens += computed

    def _append(self, req: Request, token: int, lp, now: float) -> None:
        m = req.metrics
        with self.metrics.lock:
            if m.first_token_time is None:
                m.first_token_time = now
                self.metrics.ttft.observe(now - m.arrival_time)
            else:
                self.metrics.itl.observe(now - m.last_token_time)
            self.metrics.generation_tokens += 1
        m.last_token_time = now
        if req.grammar is not None and not req.grammar.accept(token):
            # Only a token sampled elsewhere without the constraint gets here.
            logger.error("%s: token %d is not allowed by its grammar", req.request_id, token)
            self.scheduler.finish(req, "abort")
            self._count_finished(req)
            return
        req.append_token(token)
        if lp is not None and req.logprobs is not None:
            req.logprobs.append(lp)
            req.cumulative_logprob += lp.logprob
        delta = req.detokenizer.add_tokens([token])
        stop = check_stop(
            req.params,
            token,
            req.num_output_tokens,
            self.eos_token_ids,
            req.detokenizer.text,
            len(delta),
        )
        if stop.truncate_to is not None:
            req.text_limit = stop.truncate_to
        elif stop.finished:
            req.detokenizer.flush()  # an incomplete character at the very end
        if not stop.finished and req.grammar is not None and req.grammar.terminated:
            stop = StopResult(True, "stop", None, None)  # the grammar ended (ignore_eos)
        if stop.finished:
            self.scheduler.finish(req, stop.finish_reason, stop.stop_reason)
            self._count_finished(req)

    def _count_finished(self, req: Request) -> None:
        now = time.monotonic()
        req.metrics.finished_time = now
        with self.metrics.lock:
            self.metrics.finished[req.finish_reason] = (
                self.metrics.finished.get(req.finish_reason, 0) + 1
            )
            self.metrics.e2e.observe(now - req.metrics.arrival_time)

    def _make_output(self, parent: _Parent, final: bool) -> RequestOutput:
        choices = []
        for req in parent.children:
            text = req.detokenizer.text[: req.text_limit]
            # Hold back a tail that might be the start of a stop string until we know.
            visible = len(text) if req.is_finished else safe_text_len(text, req.params.stop)
            choices.append((req, text, visible))
        first = parent.children[0]
        return build_output(
            parent.request_id,
            parent.prompt,
            parent.prompt_token_ids,
            choices,
            final,
            first.metrics,
            first.prompt_logprobs,
        )

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


def kernel_shape(m: ModelConfig, int8: bool) -> ModelShape:
    """What the Triton kernels see of model ``m`` (kernels/variants.py); ``int8``: its
    projections and LM head are int8 GEMMs."""
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    projections = (
        (q + 2 * kv, m.hidden_size),
        (m.hidden_size, q),
        (2 * m.intermediate_size, m.hidden_size),
        (m.hidden_size, m.intermediate_size),
        (m.vocab_size, m.hidden_size),
    )
    return ModelShape(
        m.num_heads,
        m.num_kv_heads,
        m.head_dim,
        m.num_layers,
        m.qk_norm,
        projections if int8 else (),
    )


def step_clock(device: torch.device) -> float:
    """time.perf_counter() once the work queued on ``device`` is done, where the step timer
    splits a step: on CUDA a torch.cuda.synchronize (else the forward's GPU time would be booked
    to whatever waits for it next), on the CPU nothing."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _parent_id(req: Request) -> str:
    rid = req.request_id
    return rid.rsplit("#", 1)[0] if req.params.n > 1 else rid
