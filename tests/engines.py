"""Engines on the default model, built small, and a loop that runs prompts to the end: shared by the
engine, connector and cluster tests."""

from engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.core.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_engine(
    num_blocks=256,
    max_tokens=2048,
    max_seqs=64,
    block_size=16,
    prefix=True,
    speculative: SpeculativeConfig | None = None,
    **seams,
):
    """``seams``: LLMEngine's connector_factory and block_listener."""
    return LLMEngine(
        EngineConfig(
            model="default",
            dtype="float32",
            device="cpu",
            cache=CacheConfig(
                num_blocks=num_blocks, block_size=block_size, enable_prefix_caching=prefix
            ),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs),
            speculative=speculative or SpeculativeConfig(),
        ),
        **seams,
    )


def run_all(engine, prompts, params=GREEDY):
    """Each prompt with ``params`` (one SamplingParams for all, or one per prompt), to the end,
    checking the cache's integrity after every step; the final outputs in prompt order."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
        engine.check_integrity()
    return [final[r] for r in rids]
