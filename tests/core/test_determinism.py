"""Deterministic by default (EngineConfig.deterministic): a request's tokens and logprobs are those
of its solo run, bit for bit, whatever else the engine is doing: the batch it lands in, the
chunk budget and where its chunks fall, when it and the others arrive, preemption and recompute,
and prefix-cache hits. Greedy and seeded sampling, n > 1, float32 and bf16; the default model's
vector paths too; each KV cache dtype (int8 and bf16 as well as the activations'). With
``deterministic=False`` the batch still moves the logits (the test that
shows the switch is real)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import tiny_model

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.llm_engine import LLMEngine
from engine.kernels import native
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on this machine")


def engine(
    model, dtype="float32", budget=2048, seqs=64, blocks=512, prefix=True, det=True, kv="auto"
):
    e = LLMEngine(
        EngineConfig(
            model=model,
            dtype=dtype,
            kv_cache_dtype=kv,
            device="cpu",
            deterministic=det,
            cache=CacheConfig(num_blocks=blocks, block_size=16, enable_prefix_caching=prefix),
            scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=seqs),
        )
    )
    if det and not e.parts.runner.model.deterministic:
        pytest.skip("the C layers do not apply on this CPU (no vector row dots)")
    return e


def run(e, schedule):
    """schedule: (arrival step, prompt ids, params) per request; each request's final outputs
    as (token ids, logprobs) per completion, in schedule order."""
    rids: dict[int, str] = {}
    final = {}
    step = 0
    while len(rids) < len(schedule) or e.has_unfinished_requests():
        for i, (at, ids, sp) in enumerate(schedule):
            if at == step and i not in rids:
                rids[i] = e.add_request(ids, sp)
        for o in e.step():
            if o.finished:
                final[o.request_id] = o
        step += 1
    return [
        [(c.token_ids, c.logprobs) for c in final[rids[i]].outputs] for i in range(len(schedule))
    ]


def solo(model, dtype, schedule, kv="auto"):
    e = engine(model, dtype, kv=kv)
    return [run(e, [(0, ids, sp)])[0] for _, ids, sp in schedule]


def params(rng: random.Random, n_max=1):
    """Greedy or seeded, sometimes with penalties, top-k/p, min-p or a regex to match."""
    greedy = rng.random() < 0.5
    extra = {}
    if rng.random() < 0.3:
        extra = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2)
    if not greedy and rng.random() < 0.5:
        extra |= dict(top_k=20, top_p=0.9, min_p=0.05)
    if rng.random() < 0.2:
        extra |= dict(structured_outputs={"regex": "[a-z ]{1,12}"})
    return SamplingParams(
        max_tokens=rng.randint(1, 12),
        temperature=0.0 if greedy else 0.9,
        seed=None if greedy else rng.randint(0, 1000),
        n=1 if greedy else rng.randint(1, n_max),
        logprobs=2,
        ignore_eos="structured_outputs" not in extra,
        **extra,
    )


def prompts(rng: random.Random, count: int, vocab=49152):
    """Random prompts, some sharing a prefix with an earlier one (prefix-cache hits)."""
    out: list[list[int]] = []
    for _ in range(count):
        fresh = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 300))]
        if out and rng.random() < 0.4:
            base = rng.choice(out)
            fresh = base[: rng.randint(1, len(base))] + fresh[: rng.randint(0, 40)]
        out.append(fresh)
    return out


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seed=st.integers(0, 2**16),
    count=st.integers(2, 7),
    budget=st.sampled_from([16, 48, 100, 256, 2048]),
    seqs=st.integers(1, 6),
    blocks=st.sampled_from([40, 512]),  # 40 blocks of 16: preemption and recompute
    dtype=st.sampled_from(["float32", "bfloat16"]),
    kv=st.sampled_from(["auto", "int8", "bfloat16"]),  # --kv-cache-dtype
)
def test_each_request_is_its_solo_run_bit_for_bit(seed, count, budget, seqs, blocks, dtype, kv):
    rng = random.Random(seed)
    model = tiny_model("llama")
    schedule = [(rng.randint(0, 6), ids, params(rng, 3)) for ids in prompts(rng, count)]
    expected = solo(model, dtype, schedule, kv)
    got = run(engine(model, dtype, budget, seqs, blocks, kv=kv), schedule)
    assert got == expected


def test_the_default_models_vector_paths_are_batch_invariant():
    # head_dim 64 takes the attention's vector paths; 9 query heads over 3 KV heads
    rng = random.Random(7)
    schedule = [(rng.randint(0, 3), ids, params(rng, 2)) for ids in prompts(rng, 5)]
    schedule.append((1, list(range(1000, 1600)), params(rng)))  # 600 tokens: three 256-chunks
    expected = solo("default", "float32", schedule)
    for budget, seqs in [(64, 3), (512, 8)]:
        assert run(engine("default", "float32", budget, seqs), schedule) == expected


def test_without_it_the_batch_moves_the_logprobs():
    # the switch is real: torch's GEMMs for prefill chunks give other bits than decode rows, so
    # at least one request's logprobs differ between its solo run and a batched one
    model = tiny_model("llama")
    rng = random.Random(3)
    schedule = [(0, ids, params(rng)) for ids in prompts(rng, 6)]
    alone = []
    e = engine(model, det=False)
    for _, ids, sp in schedule:
        alone.append(run(e, [(0, ids, sp)])[0])
    together = run(engine(model, budget=64, det=False), schedule)
    assert together != alone


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_a_prefix_loaded_from_the_pool_gives_the_recomputes_bits(kv):
    # the pool's DRAM tier hands back the KV bits the first run computed; the second run
    # computes only the tail, in another batch shape, and must give the first run's logprobs
    from engine.llm import LLM

    model = str(tiny_model("llama"))
    ids = list(range(2000, 2150))  # 9 full blocks, then 6 tokens
    sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)

    def sig(out):
        c = out.outputs[0]
        return c.token_ids, c.logprobs

    with LLM(model, dtype="float32", device="cpu", enable_prefix_caching=False,
             kv_cache_dtype=kv) as llm:  # fmt: skip
        if not llm.engine.model.deterministic:
            pytest.skip("the C layers do not apply on this CPU (no vector row dots)")
        want = sig(llm.generate([ids], sp)[0])
    with LLM(model, dtype="float32", device="cpu", kv_pool="dram=16MiB", kv_cache_dtype=kv) as llm:
        assert sig(llm.generate([ids], sp)[0]) == want
        assert llm.engine.connector.flush()
        assert llm.reset_prefix_cache() > 0
        again = llm.generate([ids, list(range(5000, 5100))], [sp, sp])[0]
        assert again.metrics.kv_sources == {"dram": 144}
        assert sig(again) == want
