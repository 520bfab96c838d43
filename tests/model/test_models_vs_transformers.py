"""Tiny random Llama, Qwen2, Qwen3 and Mistral models (saved with transformers' save_pretrained)
through our runtime against transformers: float32 logits at every position of a 64-token prompt."""

from __future__ import annotations

import pytest
import torch
from tiny_models import KINDS, tiny_model

from engine.config import CacheConfig, EngineConfig
from engine.core.llm_engine import LLMEngine


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(kind):
    from transformers import AutoModelForCausalLM

    path = str(tiny_model(kind))
    engine = LLMEngine(
        EngineConfig(model=path, dtype="float32", device="cpu", cache=CacheConfig(num_blocks=64))
    )
    ids = engine.tokenizer.encode("Tiny models, random weights: héllo wörld 你好 🙂 " * 8)[:64]
    assert len(ids) == 64
    ours = engine.prompt_logits(ids)
    # A chunked prefill through the paged cache must agree as well (prefix + chunk path).
    chunked = engine.prompt_logits(ids, chunk_size=20)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert relative_error(ours, ref) <= 1e-4, kind
    assert relative_error(chunked, ref) <= 1e-4, kind
