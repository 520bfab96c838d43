"""Prompt logprobs through the scheduler (chunked prefill, the prefix cache, n > 1, preemption
aside) against the engine's own full-prompt logits, and through the embedded LLM API. Their
agreement with transformers is in tests/model/test_smollm2_vs_transformers.py."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.llm_engine import LLMEngine

TEXT = (
    "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods. "
    "Nobody saw it again, but the farmer kept a lamp in the window every night after that."
)


@pytest.fixture(scope="module")
def engine():
    # A 16-token budget: a 20+ token prompt runs in several chunks.
    return LLMEngine(
        EngineConfig(
            model="default",
            dtype="float32",
            device="cpu",
            cache=CacheConfig(num_blocks=128, block_size=16),
            scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8),
        )
    )


def run(engine, ids, params):
    rid = engine.add_request(ids, params)
    final = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                final = o
    engine.check_integrity()
    return final


def reference(engine, ids) -> torch.Tensor:
    return torch.log_softmax(engine.prompt_logits(ids), dim=-1)


def check(plp, ids, ref, k):
    assert len(plp) == len(ids) and plp[0] is None
    for p in range(1, len(ids)):
        entry, row = plp[p], ref[p - 1]
        assert ids[p] in entry
        assert entry[ids[p]].logprob == pytest.approx(float(row[ids[p]]), abs=1e-4)
        assert entry[ids[p]].rank == int((row > row[ids[p]]).sum()) + 1
        top = set(row.topk(k).indices.tolist()) if k else set()
        assert set(entry) == top | {ids[p]}


@pytest.mark.parametrize("k", [0, 5])
def test_chunked_prefill_fills_every_position(engine, k):
    ids = engine.tokenizer.encode(TEXT)
    assert len(ids) > 2 * 16
    out = run(engine, ids, SamplingParams(max_tokens=2, prompt_logprobs=k))
    check(out.prompt_logprobs, ids, reference(engine, ids), k)


def test_prefix_cache_is_bypassed(engine):
    """A cached prefix has no logits: the request recomputes its prompt instead."""
    ids = engine.tokenizer.encode(TEXT)
    run(engine, ids, SamplingParams(max_tokens=1))  # fills the prefix cache
    again = run(engine, ids, SamplingParams(max_tokens=1))
    assert again.metrics.num_cached_tokens > 0  # the cache does hold the prompt
    out = run(engine, ids, SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert out.metrics.num_cached_tokens == 0
    check(out.prompt_logprobs, ids, reference(engine, ids), 1)


def test_n_children_share_one_list_and_plain_requests_have_none(engine):
    ids = engine.tokenizer.encode(TEXT)[:20]
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=2, prompt_logprobs=0)
    out = run(engine, ids, params)
    assert len(out.outputs) == 2
    check(out.prompt_logprobs, ids, reference(engine, ids), 0)
    assert run(engine, ids, SamplingParams(max_tokens=1)).prompt_logprobs is None


def test_out_of_range_is_refused():
    with pytest.raises(ValueError, match="prompt_logprobs must be None or in"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


def test_through_the_llm_api(engine):
    llm = LLM.from_config(engine.config)
    try:
        out = llm.generate(TEXT, SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
        ids = out.prompt_token_ids
        check(out.prompt_logprobs, ids, reference(engine, ids), 2)
        assert out.prompt_logprobs[1][ids[1]].decoded_token == llm.engine.tokenizer.decode(
            [ids[1]], skip_special_tokens=False
        )
    finally:
        llm.close()
