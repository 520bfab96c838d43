"""The default model (SmolLM2-135M GGUF) against HF transformers loading the same file."""

from __future__ import annotations

import os

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

PROMPTS = [
    "The history of the Roman Empire begins",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Quelle est la capitale de la France ? Réponds en une phrase.",
    "List three colors:",
]


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(
        EngineConfig(
            model="default",
            dtype="float32",
            device="cpu",
            cache=CacheConfig(num_blocks=512, block_size=16),
            scheduler=SchedulerConfig(max_num_batched_tokens=512),
        )
    )


@pytest.fixture(scope="module")
def hf_model(engine):
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(engine.model_path)
    return AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


def prompt_64(engine) -> list[int]:
    text = " ".join(PROMPTS) * 4
    ids = engine.tokenizer.encode(text)[:64]
    assert len(ids) == 64
    return ids


def test_logits_match_transformers_every_position(engine, hf_model):
    ids = prompt_64(engine)
    ours = engine.prompt_logits(ids)
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape == (64, engine.model_config.vocab_size)
    assert relative_error(ours, ref) <= 1e-4
    engine.check_integrity()


@pytest.mark.parametrize("chunk", [1, 7, 16, 33])
def test_chunked_prefill_logits_equal_whole_prefill(engine, chunk):
    ids = prompt_64(engine)
    whole = engine.prompt_logits(ids)
    chunked = engine.prompt_logits(ids, chunk_size=chunk)
    assert relative_error(chunked, whole) <= 1e-5


def hf_greedy(hf_model, ids: list[int], steps: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            pad_token_id=2,
        )
    return out[0, len(ids) :].tolist()


def engine_greedy(engine, prompts: list[list[int]], steps: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in prompts]
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o.outputs[0].token_ids
    engine.check_integrity()
    return [final[r] for r in rids]


@pytest.mark.slow  # CI time on a 2-core Zen 3 EPYC: `pytest -m slow`
def test_greedy_tokens_match_transformers_alone_and_batched(engine, hf_model):
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) > 1  # mixed lengths
    ref = [hf_greedy(hf_model, p, 32) for p in prompts]
    alone = [engine_greedy(engine, [p], 32)[0] for p in prompts]
    batched = engine_greedy(engine, prompts, 32)
    assert alone == ref
    assert batched == ref


def test_prompt_logprobs_match_transformers(engine, hf_model):
    """SamplingParams.prompt_logprobs through the scheduler: each prompt token's logprob, rank
    and top-k against log_softmax of transformers' float32 logits at the position before it."""
    ids = prompt_64(engine)[:40]
    k = 3
    rid = engine.add_request(ids, SamplingParams(max_tokens=1, prompt_logprobs=k))
    final = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                final = o
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    plp = final.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    for p in range(1, len(ids)):
        row, token = ref[p - 1], ids[p]
        entry = plp[p]
        assert abs(entry[token].logprob - float(row[token])) <= 1e-3, p
        # The rank counts the tokens with a higher logprob (near-ties either way).
        lo, hi = (int((row > row[token] + d).sum()) + 1 for d in (1e-4, -1e-4))
        assert lo <= entry[token].rank <= hi, p
        top = row.topk(k)
        ours_top = sorted((v for t, v in entry.items() if v.rank <= k), key=lambda v: v.rank)
        assert len(ours_top) == k
        for want, got in zip(top.values.tolist(), ours_top):
            assert abs(got.logprob - want) <= 1e-3, p
        assert set(top.indices.tolist()) <= set(entry)
        text = engine.tokenizer.decode([token], skip_special_tokens=False)
        assert entry[token].decoded_token == text
    engine.check_integrity()
