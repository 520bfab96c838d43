"""The embedded API: ``from engine import LLM, SamplingParams``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.errors import RequestError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, str]


class LLM:
    """An engine in this process. Many prompts in one call run batched (continuous batching).

    >>> llm = LLM()                     # the default model, SmolLM2-135M-Instruct
    >>> llm.generate("The capital of France is", SamplingParams(max_tokens=8))[0].outputs[0].text
    """

    def __init__(
        self,
        model: str = "default",
        *,
        dtype: str = "auto",
        weight_dtype: str = "auto",  # the float weights' dtype (EngineConfig.weight_dtype)
        kv_cache_dtype: str = "auto",  # the KV cache's (EngineConfig.kv_cache_dtype)
        device: str = "auto",
        quantization: str | None = None,
        compile: bool = False,
        deterministic: bool = True,  # batch-invariant on the CPU (EngineConfig.deterministic)
        max_model_len: int | None = None,
        rope_scaling: str | None = None,  # JSON, as Hugging Face writes it (EngineConfig)
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory_gb: float | None = None,  # None: sized for the model (config.py)
        gpu_memory_utilization: float = 0.85,  # this process's share of its GPU (config.py)
        enable_prefix_caching: bool = True,
        max_num_batched_tokens: int | None = None,  # None: the device's default (config.py)
        max_num_seqs: int = 128,
        # "fcfs", or "priority": generate's ``priority`` orders the queue (SchedulerConfig.policy)
        scheduling_policy: str = "fcfs",
        seed: int = 0,
        show_progress: bool = False,
        kv_pool: str | None = None,
        # Draftless speculative decoding, as vLLM's LLM takes it: {"method": "ngram",
        # "num_speculative_tokens": 5, "prompt_lookup_max": 4} (the fields of SpeculativeConfig)
        speculative_config: SpeculativeConfig | dict | None = None,
    ) -> None:
        if isinstance(speculative_config, dict):
            speculative_config = SpeculativeConfig.from_dict(speculative_config)
        config = EngineConfig(
            model=model,
            dtype=dtype,
            weight_dtype=weight_dtype,
            kv_cache_dtype=kv_cache_dtype,
            device=device,
            quantization=quantization,
            compile=compile,
            deterministic=deterministic,
            max_model_len=max_model_len,
            rope_scaling=rope_scaling,
            seed=seed,
            cache=CacheConfig(
                block_size=block_size,
                num_blocks=num_blocks,
                kv_cache_memory_gb=kv_cache_memory_gb,
                gpu_memory_utilization=gpu_memory_utilization,
                enable_prefix_caching=enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=max_num_batched_tokens,
                max_num_seqs=max_num_seqs,
                policy=scheduling_policy,
            ),
            speculative=speculative_config or SpeculativeConfig(),
            show_progress=show_progress,
            kv_pool=kv_pool,
        )
        self._init(LLMEngine(config))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm._init(LLMEngine(config))
        return llm

    def _init(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or many (strings or token-id lists); outputs in input order.

        ``priority`` (vLLM's): one int per prompt, a lower value served first, under
        ``scheduling_policy="priority"`` (under "fcfs" every one must be 0).

        Every prompt is validated before any runs: one bad prompt raises ValueError and nothing
        is queued."""
        prompts = _as_prompt_list(prompts)
        params_list = _as_params_list(params, len(prompts))
        priorities = _as_priority_list(priority, len(prompts))
        encoded = [self._encode(p) for p in prompts]
        for ids, sp, prio in zip(encoded, params_list, priorities):
            self.engine.validate(ids, sp, prio)
        order = [
            self.engine.add_request(
                ids, sp, prompt_text=p if isinstance(p, str) else None, priority=prio
            )
            for p, ids, sp, prio in zip(prompts, encoded, params_list, priorities)
        ]
        final: dict[str, RequestOutput] = {}
        try:
            for outs in self.engine.run_until_done(use_tqdm, total=len(order)):
                for o in outs:
                    if o.finished:
                        final[o.request_id] = o
        except BaseException:
            for rid in order:
                self.engine.abort_request(rid)
            self.engine.step()  # drain the abort outputs
            raise
        return [final[rid] for rid in order]

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Chat completion(s) with the model's chat template. One conversation or a list;
        ``priority``: one per conversation, as generate's."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.apply_chat_template(c) for c in convs]
        return self.generate(prompts, params, use_tqdm=use_tqdm, priority=priority)

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, priority: int = 0
    ) -> Iterator[str]:
        """Yield text deltas of one request as they are generated."""
        ids = self._encode(prompt)
        text = prompt if isinstance(prompt, str) else None
        params = params or SamplingParams()
        rid = self.engine.add_request(ids, params, prompt_text=text, priority=priority)
        done = False
        try:
            while not done:
                for o in self.engine.step():
                    if o.request_id != rid:
                        continue
                    delta = o.outputs[0].new_text
                    if delta:
                        yield delta
                    done = o.finished
        finally:
            if not done:
                self.engine.abort_request(rid)
                self.engine.step()

    def reset_prefix_cache(self) -> int:
        """Drop the device cache's unreferenced prefix blocks (blocks of running requests stay);
        returns how many. The KV pool (``kv_pool``) keeps its blocks."""
        return self.engine.reset_prefix_cache()

    def close(self) -> None:
        """Stop the KV pool's IO threads and release its shared memory (also done at exit)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def apply_chat_template(self, messages: list[Message]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _encode(self, prompt: Prompt) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    if not prompts:
        raise RequestError("prompts must not be empty", "prompts")
    return prompts


def _as_priority_list(priority, n: int) -> list:
    """One priority per prompt (each checked by the engine); RequestError naming ``priority``
    for anything but a list of as many."""
    if priority is None:
        return [0] * n
    if isinstance(priority, (str, bytes, dict)) or not isinstance(priority, Sequence):
        raise RequestError(
            f"priority must be a list with one int per prompt, got {type(priority).__name__}",
            "priority",
        )
    if len(priority) != n:
        raise RequestError(f"priority has {len(priority)} entries for {n} prompts", "priority")
    return list(priority)


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise RequestError(f"params has {len(params)} entries for {n} prompts", "params")
    return params
