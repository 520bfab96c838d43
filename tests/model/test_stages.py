"""Pipeline stages of the model (engine/pipeline_stage.py, issue 22's chunked pipeline): a stage
holds and reads only its layers' weights (the embedding on the first, the final norm and LM head
on the last, the embedding on the last too when tied), its own KV cache, and the stages' forwards
chained give the whole model's hidden states and logits bit for bit, chunk after chunk."""

from __future__ import annotations

import os

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from tiny_models import tiny_gguf, tiny_model

import engine.model.gguf_loader as gguf_loader
from engine.config import ModelConfig
from engine.core.model_runner import ModelRunner
from engine.core.request import Request
from engine.core.scheduler_output import ScheduledRequest
from engine.kvcache.paged_cache import PagedKVCache
from engine.model.builder import build_model
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import (
    expected_weight_shapes,
    open_checkpoint,
    read_weights,
    stage_weight_names,
)
from engine.pipeline_stage import PipelineStage
from engine.sampling_params import SamplingParams

CPU = torch.device("cpu")
BLOCK = 16


def stages(n: int) -> list[PipelineStage]:
    return [PipelineStage(i, n) for i in range(n)]


# -- more stages than layers (the stage itself: tests/test_pipeline_stage.py) -----------------


def test_a_model_refuses_more_stages_than_layers():
    with pytest.raises(ValueError, match="at most 2 stages, not 3"):
        LlamaForCausalLM(random_config(layers=2), torch.float32, CPU, PipelineStage(2, 3))


# -- what a stage holds and reads ------------------------------------------------------------


def held(model: LlamaForCausalLM) -> dict[str, int]:
    """Tensors by kind: layers' parameters, embedding, norm, separate LM head."""
    names = list(model.runtime_weights())
    return {
        "layer_tensors": sum(n.startswith("layers.") for n in names),
        "embed_tokens": names.count("embed_tokens"),
        "norm": names.count("norm.weight"),
        "lm_head": names.count("lm_head"),
        "all": len(names),
    }


@pytest.fixture(scope="module")
def smollm2_checkpoint():
    return open_checkpoint("default")


@pytest.mark.parametrize(
    "spec, layers",
    [("0/1", range(30)), ("0/2", range(0, 15)), ("1/2", range(15, 30))]
    + [("0/3", range(0, 10)), ("1/3", range(10, 20)), ("2/3", range(20, 30))],
)
def test_a_stage_of_the_default_model_holds_only_its_tensors(smollm2_checkpoint, spec, layers):
    # SmolLM2-135M: 30 layers of 6 runtime tensors (2 norms, fused qkv, o, fused gate/up, down),
    # tied embeddings. Built on the meta device: the count needs no memory.
    _, checkpoint = smollm2_checkpoint
    cfg = checkpoint.config
    assert cfg.num_layers == 30 and cfg.tie_word_embeddings
    stage = PipelineStage.parse(spec)
    model = LlamaForCausalLM(cfg, torch.float32, torch.device("meta"), stage)
    assert model.layer_range == layers and len(model.layers) == len(layers)
    want = {
        "layer_tensors": 6 * len(layers),
        "embed_tokens": int(stage.is_first or stage.is_last),  # tied: the last's LM head
        "norm": int(stage.is_last),
        "lm_head": 0,
    }
    want["all"] = sum(want.values())
    assert held(model) == want
    assert {
        int(n.split(".")[1]) for n in model.runtime_weights() if n.startswith("layers.")
    } == set(layers)
    assert (model.lm_head is not None and model.lm_head is model.embed_tokens) == stage.is_last
    assert (model.norm is not None) == stage.is_last
    # The HF tensors it reads: 9 per layer (q, k, v, o, gate, up, down, 2 norms).
    names = stage_weight_names(cfg, stage)
    assert len(names) == 9 * len(layers) + want["embed_tokens"] + want["norm"]
    assert set(names) <= set(expected_weight_shapes(cfg))


@pytest.fixture
def reads(monkeypatch):
    """GGUF tensors read (dequantized), by HF-less GGUF name."""
    names: list[str] = []
    original = gguf_loader._read_tensor

    def counting(tensor, heads):
        names.append(tensor.name)
        return original(tensor, heads)

    monkeypatch.setattr(gguf_loader, "_read_tensor", counting)
    return names


def test_the_default_model_stage_reads_only_its_tensors(reads):
    built = build_model("default", torch.float32, CPU, use_cache=False, stage=PipelineStage(2, 3))
    assert built.model.layer_range == range(20, 30)
    assert len(reads) == 9 * 10 + 2  # its layers, the final norm, the (tied) embedding
    assert {n.split(".")[1] for n in reads if n.startswith("blk.")} == {
        str(i) for i in range(20, 30)
    }
    assert {n for n in reads if not n.startswith("blk.")} == {
        "token_embd.weight",
        "output_norm.weight",
    }
    assert held(built.model)["all"] == 6 * 10 + 2


@pytest.mark.parametrize("kind", ["llama", "llama_tied"])
def test_a_stage_reads_only_its_tensors_and_holds_the_whole_models(
    tmp_path, monkeypatch, reads, kind
):
    monkeypatch.setenv("ENGINE_WEIGHT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("ENGINE_WEIGHT_CACHE", raising=False)
    path = str(tiny_gguf(kind, QType.Q8_0))
    whole = build_model(path, torch.float32, CPU)
    everything = whole.model.runtime_weights()
    files = {whole.cache_file}
    for stage in stages(2):
        reads.clear()
        built = build_model(path, torch.float32, CPU, stage=stage)
        # 9 tensors for its layer, + the embedding (first), + the norm and the LM head (last;
        # the embedding when tied)
        assert len(reads) == 9 + (1 if stage.is_first else 2)
        if stage.is_last:
            head = "token_embd.weight" if kind == "llama_tied" else "output.weight"
            assert {"output_norm.weight", head} <= set(reads)
        assert all(n.startswith(f"blk.{stage.index}.") for n in reads if n.startswith("blk."))
        got = built.model.runtime_weights()
        assert got.keys() < everything.keys()
        assert all(torch.equal(t, everything[n]) for n, t in got.items())
        # Its own weight cache file, mapped on the next start, without reading the checkpoint.
        assert not built.cache_hit and built.cache_file not in files
        assert f"-stage{stage.index}of2." in os.path.basename(built.cache_file)
        files.add(built.cache_file)
        reads.clear()
        again = build_model(path, torch.float32, CPU, stage=stage)
        assert again.cache_hit and again.cache_file == built.cache_file and not reads
        assert all(torch.equal(t, got[n]) for n, t in again.model.runtime_weights().items())
    # Neither the stages' files nor the whole model's pruned one another.
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(f) for f in files)
    reads.clear()
    assert build_model(path, torch.float32, CPU).cache_hit and not reads


def test_a_stage_of_a_sharded_hf_directory_reads_only_its_tensors():
    path, checkpoint = open_checkpoint(str(tiny_model("llama_sharded")))
    whole = read_weights(checkpoint, path, torch.float32, CPU, False)
    for stage in stages(2):
        weights = read_weights(checkpoint, path, torch.float32, CPU, False, stage)
        assert list(weights) == stage_weight_names(checkpoint.config, stage)
        assert all(torch.equal(t, whole[n]) for n, t in weights.items())
        model = LlamaForCausalLM(checkpoint.config, torch.float32, CPU, stage)
        model.load_weights(weights, source=path)


# -- the stages chained against the whole model -----------------------------------------------


def random_config(layers: int = 5, tied: bool = False, bias: bool = False) -> ModelConfig:
    return ModelConfig(
        architecture="qwen2" if bias else "llama",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        attention_bias=bias,
        tie_word_embeddings=tied,
    )


def random_model(cfg: ModelConfig, dtype: torch.dtype) -> LlamaForCausalLM:
    g = torch.Generator().manual_seed(0)
    model = LlamaForCausalLM(cfg, dtype, CPU)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.2 * noise)
    return model


def stage_models(whole: LlamaForCausalLM, n: int) -> list[LlamaForCausalLM]:
    """The ``n`` stages of ``whole``, holding its very tensors (adopt_weights)."""
    weights = whole.runtime_weights()
    out = []
    for stage in stages(n):
        model = LlamaForCausalLM(whole.cfg, whole.dtype, CPU, stage)
        model.adopt_weights({name: weights[name] for name in model.runtime_weights()})
        out.append(model)
    return out


def runner() -> ModelRunner:
    r = ModelRunner.__new__(ModelRunner)  # prepare needs no model: the steps' metadata
    r.device, r.block_size, r.graphs = CPU, BLOCK, None
    return r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("chunks", [[37], [16, 21], [5, 19, 13]], ids=["one", "two", "three"])
@pytest.mark.parametrize("shape", [{}, {"tied": True, "bias": True}], ids=["untied", "tied-bias"])
def test_chained_stages_equal_the_whole_model(dtype, n, chunks, shape):
    """A prompt prefilled in ``chunks`` (each chunk attending to the earlier ones' KV in each
    stage's own cache), then two decode steps: every step's hidden states and logits equal the
    whole model's bit for bit, and each stage's cache holds the whole model's KV of its layers."""
    whole = random_model(random_config(**shape), dtype)
    chain_equals_whole(whole, stage_models(whole, n), chunks)


def test_the_default_models_stages_chained_equal_it():
    whole = build_model("default", torch.float32, CPU, use_cache=False).model
    chain_equals_whole(whole, stage_models(whole, 2), [24, 16])


def chain_equals_whole(
    whole: LlamaForCausalLM, parts: list[LlamaForCausalLM], chunks: list[int], decodes: int = 2
) -> None:
    dtype = whole.dtype
    num_blocks = 7
    table = {"r": [5, 0, 3, 6]}  # 64 slots, out of order
    assert sum(chunks) + decodes <= 64
    cache = PagedKVCache(whole.cfg, num_blocks, BLOCK, dtype, CPU)
    whole.bind_kv_cache(cache.kv)
    caches = []
    for part in parts:
        c = PagedKVCache(whole.cfg, num_blocks, BLOCK, dtype, CPU, num_layers=len(part.layers))
        part.bind_kv_cache(c.kv)
        caches.append(c)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, whole.cfg.vocab_size, (sum(chunks),), generator=g).tolist()
    req = Request("r", prompt, SamplingParams(), None)
    with torch.inference_mode():
        for step, size in enumerate(list(chunks) + [1] * decodes):
            inputs = runner().prepare([ScheduledRequest(req, size)], table)
            assert inputs.meta.has_prefill == (size > 1)
            want_hooks: list[int] = []
            want = whole(inputs.input_ids, inputs.positions, inputs.meta, want_hooks.append)
            hidden = None
            for part in parts:
                hooks: list[int] = []
                ids = inputs.input_ids if part.stage.is_first else None
                hidden = part(ids, inputs.positions, inputs.meta, hooks.append, hidden=hidden)
                assert hidden.shape == want.shape and hidden.dtype == dtype
                assert hooks == list(part.layer_range)  # global layer indices
            assert want_hooks == list(range(whole.cfg.num_layers))
            assert torch.equal(hidden, want), f"step {step}"
            rows = inputs.sample_indices
            logits = parts[-1].compute_logits(hidden[rows])
            assert torch.equal(logits, whole.compute_logits(want[rows])), f"step {step}"
            req.num_computed_tokens += size
            if req.num_computed_tokens == req.num_tokens:  # sample greedily, decode it next
                token = int(logits[-1].argmax())
                req.all_token_ids.append(token)
                req.output_token_ids.append(token)
    for part, c in zip(parts, caches, strict=True):
        assert torch.equal(c.kv, cache.kv[part.layer_range.start : part.layer_range.stop])


def test_a_middle_stage_hands_on_un_normed_hidden_states():
    whole = random_model(random_config(layers=3), torch.float32)
    first, middle, last = stage_models(whole, 3)
    cache = PagedKVCache(whole.cfg, 2, BLOCK, torch.float32, CPU, num_layers=1)
    req = Request("r", list(range(1, 10)), SamplingParams(), None)
    inputs = runner().prepare([ScheduledRequest(req, 9)], {"r": [1]})
    for part in (first, middle, last):
        part.bind_kv_cache(cache.kv.clone())
    with torch.inference_mode():
        outs = [first(inputs.input_ids, inputs.positions, inputs.meta)]
        for part in (middle, last):
            outs.append(part(None, inputs.positions, inputs.meta, hidden=outs[-1]))
        # a stage's output is its last layer's output: rerun that layer on the input by hand
        layer = middle.layers[0]
        layer.attn.bind_cache(*cache.kv.clone()[0])
        assert torch.equal(outs[1], layer(inputs.positions, outs[0], inputs.meta))
        assert first.norm is None and middle.norm is None and last.norm is not None


def test_a_stage_refuses_what_it_cannot_do():
    whole = random_model(random_config(layers=4), torch.float32)
    first, last = stage_models(whole, 2)
    req = Request("r", list(range(1, 6)), SamplingParams(), None)
    inputs = runner().prepare([ScheduledRequest(req, 5)], {"r": [0]})
    hidden = torch.zeros(5, whole.cfg.hidden_size)
    with pytest.raises(ValueError, match="stage 0/2 embeds the tokens: pass input_ids"):
        first(None, inputs.positions, inputs.meta, hidden=hidden)
    with pytest.raises(ValueError, match="stage 1/2 starts at layer 2: pass the hidden states"):
        last(inputs.input_ids, inputs.positions, inputs.meta)
    with pytest.raises(ValueError, match="stage 1/2 starts at layer 2: pass the hidden states"):
        last(None, inputs.positions, inputs.meta)
    with pytest.raises(ValueError, match="stage 0/2 has no LM head"):
        first.compute_logits(hidden)
    whole_cache = PagedKVCache(whole.cfg, 2, BLOCK, torch.float32, CPU)
    with pytest.raises(ValueError, match=r"the cache has 4 layers, this stage \(1/2\) holds 2"):
        last.bind_kv_cache(whole_cache.kv)
    with pytest.raises(ValueError, match="adopt_weights: names differ"):
        last.adopt_weights(whole.runtime_weights())
    # Stages only prefill: the C decode layers stay off; int8 and packing leave out the head.
    assert not first.enable_native_decode() and not last.enable_native_decode()
    first.quantize_int8_()
    assert first.lm_qweight is None
    last.quantize_int8_()
    assert last.lm_qweight is not None
