"""Rotary scaling: each kind's frequencies (and YaRN's attention factor) equal Hugging Face's own
functions; a Hugging Face config, a GGUF's metadata and ``--rope-scaling`` give the same
RopeScaling; the context a scaling stretches to, and ``max_model_len`` past it served with a
warning, through the engine."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from tiny_models import tiny_model
from transformers import LlamaConfig
from transformers import modeling_rope_utils as hf_rope

from engine.config import EngineConfig, RopeScaling, parse_rope_scaling
from engine.layers.rotary import RotaryEmbedding, attention_factor, inverse_frequencies
from engine.model.context import extend_context
from engine.model.hf_loader import rope_from_hf

THETA, DIM, ORIGINAL = 100000.0, 64, 8192


def hf(params: dict, max_position=ORIGINAL, seq_len=None):
    cfg = LlamaConfig(
        hidden_size=DIM * 9, num_attention_heads=9, head_dim=DIM, rope_theta=THETA,
        max_position_embeddings=max_position, rope_scaling=params,
    )  # fmt: skip
    kind = params["rope_type"]
    fn = {"dynamic": hf_rope._compute_dynamic_ntk_parameters}.get(kind)
    fn = fn or hf_rope.ROPE_INIT_FUNCTIONS[kind]
    return fn(cfg, torch.device("cpu"), seq_len)


@pytest.mark.parametrize("factor", [2.0, 4.0, 8.0])
def test_yarn_is_hugging_faces(factor):
    params = dict(rope_type="yarn", factor=factor, original_max_position_embeddings=ORIGINAL)
    want, want_scale = hf(params, int(ORIGINAL * factor))
    ours = RopeScaling.from_dict(params, ORIGINAL, "test")
    torch.testing.assert_close(inverse_frequencies(DIM, THETA, ours), want, rtol=1e-6, atol=0)
    assert attention_factor(ours) == pytest.approx(want_scale) == 0.1 * math.log(factor) + 1


def test_yarn_with_its_own_betas_and_attention_factor():
    params = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4096,
                  beta_fast=16, beta_slow=2, attention_factor=1.2)  # fmt: skip
    want, scale = hf(params, 16384)
    ours = RopeScaling.from_dict(params, 4096, "test")
    torch.testing.assert_close(inverse_frequencies(DIM, THETA, ours), want, rtol=1e-6, atol=0)
    assert attention_factor(ours) == scale == 1.2


def test_dynamic_ntk_is_hugging_faces_at_the_stretched_length():
    # fixed at original x factor positions (as vLLM): Hugging Face's at that sequence length
    params = dict(rope_type="dynamic", factor=4.0)
    want, _ = hf(params, ORIGINAL, seq_len=4 * ORIGINAL)
    ours = RopeScaling.from_dict(params, ORIGINAL, "test")
    torch.testing.assert_close(inverse_frequencies(DIM, THETA, ours), want, rtol=1e-6, atol=0)
    assert ours.context == 4 * ORIGINAL


@pytest.mark.parametrize(
    "params",
    [
        dict(rope_type="linear", factor=4.0),
        dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    ],  # fmt: skip
    ids=["linear", "llama3"],
)
def test_linear_and_llama3_are_hugging_faces(params):
    want, _ = hf(params, 131072 if params["rope_type"] == "llama3" else ORIGINAL)
    ours = RopeScaling.from_dict(params, ORIGINAL, "test")
    torch.testing.assert_close(inverse_frequencies(DIM, THETA, ours), want, rtol=1e-6, atol=0)


def test_the_tables_carry_yarns_attention_factor():
    yarn = RopeScaling(kind="yarn", factor=4.0, original_max_position_embeddings=64)
    plain = RotaryEmbedding(DIM, 256, THETA, RopeScaling(), torch.device("cpu"))
    scaled = RotaryEmbedding(DIM, 256, THETA, yarn, torch.device("cpu"))
    assert scaled.cos[0, 0] == pytest.approx(attention_factor(yarn)) and plain.cos[0, 0] == 1
    assert scaled.cos.shape == (256, DIM)


def test_a_hugging_face_config_and_the_override_agree():
    params = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL)
    _, from_config = rope_from_hf({"rope_scaling": params, "max_position_embeddings": 32768}, "p")
    assert parse_rope_scaling(json.dumps(params)) == from_config


@pytest.mark.parametrize(
    "text, field",
    [
        ("{", "not a JSON object"),
        ("[1]", "not a JSON object"),
        ('{"rope_type": "yarn", "factor": 4}', "original_max_position_embeddings"),
        ('{"rope_type": "ntk", "factor": 4, "original_max_position_embeddings": 8}', "'ntk'"),
        ('{"rope_type": "yarn", "original_max_position_embeddings": 8}', "needs a factor"),
        (
            '{"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 8, "x": 1}',
            "unknown rope scaling field 'x'",
        ),
        (
            '{"rope_type": "yarn", "factor": -1, "original_max_position_embeddings": 8}',
            "rope_scaling.factor",
        ),
    ],  # fmt: skip
)
def test_a_bad_override_is_refused_by_name(text, field):
    with pytest.raises(ValueError, match="rope_scaling|rope scaling") as e:
        EngineConfig(rope_scaling=text)
    assert field in str(e.value)


def test_the_context_a_scaling_stretches_to_and_past_it():
    _, base = rope_from_hf({"max_position_embeddings": ORIGINAL}, "p")
    from engine.config import ModelConfig

    cfg = ModelConfig(
        architecture="llama", vocab_size=10, hidden_size=DIM, intermediate_size=8, num_layers=1,
        num_heads=1, num_kv_heads=1, head_dim=DIM, rms_norm_eps=1e-6, rope_theta=THETA,
        rope_scaling=base, max_position_embeddings=ORIGINAL,
    )  # fmt: skip
    assert extend_context(cfg, None, None) == (cfg, None)
    yarn = parse_rope_scaling('{"rope_type": "yarn", "factor": 4, '
                              '"original_max_position_embeddings": 8192}')  # fmt: skip
    stretched, warning = extend_context(cfg, yarn, None)
    assert stretched.max_position_embeddings == 32768 and stretched.rope_scaling == yarn
    assert warning is None
    past, warning = extend_context(cfg, None, 16384)
    assert past.max_position_embeddings == 16384 and past.rope_scaling == base
    assert "past the model's context of 8192" in warning and "--rope-scaling" in warning


def test_the_engine_serves_past_the_models_context_with_a_warning(caplog):
    # the tiny model knows 4096 positions; a 5,000-token prompt, once plainly past them (with
    # a warning) and once under YaRN (none): both answer, and the two rotary tables differ
    from engine import LLM, SamplingParams

    prompt = [(i * 7919) % 40000 + 3 for i in range(5000)]
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with caplog.at_level(logging.WARNING, logger="engine.model.builder"):
        llm = LLM(str(tiny_model("llama")), device="cpu", max_model_len=6000, num_blocks=400)
    assert any("past the model's context of 4096" in r.message for r in caplog.records)
    assert len(llm.generate([prompt], sp)[0].outputs[0].token_ids) == 3
    caplog.clear()
    yarn = '{"rope_type": "yarn", "factor": 2, "original_max_position_embeddings": 4096}'
    with caplog.at_level(logging.WARNING, logger="engine.model.builder"):
        stretched = LLM(str(tiny_model("llama")), device="cpu", rope_scaling=yarn,
                        num_blocks=600)  # fmt: skip
    assert not [r for r in caplog.records if "past the model's context" in r.message]
    assert stretched.engine.max_model_len == 8192
    assert len(stretched.generate([prompt], sp)[0].outputs[0].token_ids) == 3
    assert not torch.equal(stretched.engine.model.rotary.cos[:4096], llm.engine.model.rotary.cos)
