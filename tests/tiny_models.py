"""Tiny random Hugging Face models for tests, written with transformers' ``save_pretrained``.

Each model has the real SmolLM2 vocabulary (49152 tokens, built from the default GGUF by our own
tokenizer code), so ``tokenizer.json`` and ``tokenizer_config.json`` (with SmolLM2's ChatML chat
template) are saved beside the weights and the directory loads like a real checkpoint, in our
loader and in transformers. Shapes: hidden 64, 2 layers, 4 query heads, 2 KV heads (1 for the MQA
variant), float32. Norm weights and biases are randomised too, so a runtime that ignores one of
them gets different logits from transformers.

    build_tiny_model("qwen2", directory)   # writes there (skips work if already written)
    tiny_model("qwen2")                    # same, in a temp dir shared by the whole process
    write_gguf(tiny_model("llama"), path, QType.Q8_0)   # llama.cpp-style GGUF of a tiny model
    tiny_gguf("llama", QType.Q8_0)         # same, once per process

Import it as ``from tiny_models import ...`` from any test (pyproject's pytest ``pythonpath`` puts
tests/ on sys.path).

Plain functions, no pytest fixtures: call them from a module- or session-scoped fixture.
"""

from __future__ import annotations

import atexit
import functools
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

KINDS = (
    "llama",
    "llama_tied",
    "llama_mqa",
    "llama3_rope",
    "llama_linear_rope",
    "llama_sharded",
    "mistral",
    "qwen2",
    "qwen3",
)
_DONE = ".tiny-model-complete"
_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    initializer_range=0.08,  # wider than the default 0.02: fewer near-ties in greedy decoding
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def _config(kind: str) -> Any:
    import transformers as tf

    vocab = smollm2_tokenizer().vocab_size
    common = dict(_COMMON, vocab_size=vocab, tie_word_embeddings=False)
    if kind.startswith("llama"):
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0}
        if kind == "llama3_rope":
            rope = {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            }
        elif kind == "llama_linear_rope":
            rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
        common.update(rope_parameters=rope)
        if kind == "llama_tied":
            common.update(tie_word_embeddings=True)
        if kind == "llama_mqa":
            common.update(num_key_value_heads=1)
        return tf.LlamaConfig(**common)
    if kind == "mistral":
        return tf.MistralConfig(**common, sliding_window=None, rope_theta=1000000.0)
    if kind == "qwen2":
        return tf.Qwen2Config(**common, rope_theta=1000000.0, use_sliding_window=False)
    if kind == "qwen3":
        # head_dim 32 with hidden 64 and 4 heads: q_proj is wider than hidden, as in real Qwen3.
        return tf.Qwen3Config(**common, head_dim=32, rope_theta=1000000.0, use_sliding_window=False)
    raise ValueError(f"unknown tiny model kind {kind!r}; kinds: {', '.join(KINDS)}")


def build_tiny_model(kind: str, directory: str | os.PathLike[str]) -> Path:
    """Write the tiny model ``kind`` (one of KINDS) into ``directory``; return its path."""
    import torch
    import transformers as tf

    directory = Path(directory)
    if (directory / _DONE).exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    config = _config(kind)
    torch.manual_seed(KINDS.index(kind))
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
    shard = "300KB" if kind == "llama_sharded" else "2GB"
    model.save_pretrained(directory, max_shard_size=shard)
    if kind == "qwen2":  # a list, as real Qwen2 instruct models have
        generation = {"bos_token_id": 1, "eos_token_id": [2, 0]}
        (directory / "generation_config.json").write_text(json.dumps(generation))
    save_tokenizer(directory)
    (directory / _DONE).touch()
    return directory


def save_tokenizer(directory: str | os.PathLike[str]) -> None:
    """tokenizer.json and tokenizer_config.json of SmolLM2 (from the default GGUF)."""
    tokenizer = smollm2_tokenizer()
    directory = Path(directory)
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>",
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": tokenizer.chat_template,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


@functools.cache
def smollm2_tokenizer() -> Any:
    """Our Tokenizer for the default SmolLM2 GGUF (read once per process)."""
    from engine.model.gguf_loader import read_gguf
    from engine.model.loader import resolve_model_path
    from engine.model.tokenizer import tokenizer_from_gguf

    meta, _ = read_gguf(resolve_model_path("default"))
    return tokenizer_from_gguf(meta)


@functools.cache
def _root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="engine-tiny-models-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@functools.cache
def tiny_model(kind: str) -> Path:
    """``build_tiny_model(kind, ...)`` in a temporary directory kept for the whole process."""
    return build_tiny_model(kind, _root() / kind)


@functools.cache
def tiny_gguf(kind: str, qtype: Any = None) -> Path:
    """``write_gguf(tiny_model(kind), ...)``, written once per process."""
    name = f"{kind}-{getattr(qtype, 'name', 'F32')}.gguf"
    return write_gguf(tiny_model(kind), _root() / "gguf" / name, qtype)


_HF_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_tensor_name(hf_name: str) -> str:
    base, suffix = hf_name.rsplit(".", 1)
    if base in _HF_TO_GGUF:
        return f"{_HF_TO_GGUF[base]}.{suffix}"
    _, _, layer, rest = base.split(".", 3)  # model.layers.{i}.<rest>
    return f"blk.{layer}.{_HF_TO_GGUF[rest]}.{suffix}"


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (for q with num_heads query heads,
    for k with the KV head count)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf(
    hf_dir: str | os.PathLike[str],
    path: str | os.PathLike[str],
    qtype: Any = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """Convert a tiny HF model directory to GGUF as llama.cpp's converter does: llama.* /
    qwen2.* / qwen3.* metadata, permuted Llama q/k rows, rope_freqs for Llama 3 scaling, the
    byte-level BPE vocabulary. 2-D weights are stored as ``qtype`` (gguf.quants must be able to
    quantize it: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1); norms and biases as F32.
    ``extra_tensors`` (GGUF name -> array) are added as they are, to test errors."""
    import gguf
    from safetensors.numpy import load_file

    qtype = gguf.GGMLQuantizationType.F32 if qtype is None else qtype
    hf_dir, path = Path(hf_dir), Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = {"llama": "llama", "mistral": "llama"}.get(cfg["model_type"], cfg["model_type"])
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny {cfg['model_type']}")
    writer.add_uint32(f"{arch}.block_count", cfg["num_hidden_layers"])
    writer.add_uint32(f"{arch}.context_length", cfg["max_position_embeddings"])
    writer.add_uint32(f"{arch}.embedding_length", cfg["hidden_size"])
    writer.add_uint32(f"{arch}.feed_forward_length", cfg["intermediate_size"])
    writer.add_uint32(f"{arch}.attention.head_count", heads)
    writer.add_uint32(f"{arch}.attention.head_count_kv", kv_heads)
    writer.add_float32(f"{arch}.rope.freq_base", theta)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    writer.add_uint32(f"{arch}.vocab_size", cfg["vocab_size"])
    writer.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    if head_dim != cfg["hidden_size"] // heads:
        writer.add_uint32(f"{arch}.attention.key_length", head_dim)
        writer.add_uint32(f"{arch}.attention.value_length", head_dim)
    if rope.get("rope_type") == "linear":
        writer.add_string(f"{arch}.rope.scaling.type", "linear")
        writer.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
    _add_tokenizer(writer, hf_dir)

    state = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(file))
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(rope, head_dim, theta))
    for name, weight in state.items():
        weight = weight.astype(np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            weight = llama_cpp_permute(weight, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            weight = llama_cpp_permute(weight, kv_heads)
        if weight.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(weight, qtype)
            writer.add_tensor(gguf_tensor_name(name), data, raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_tensor_name(name), weight)
    for name, value in (extra_tensors or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(writer: Any, hf_dir: Path) -> None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    types = [1] * len(tokens)
    for added in tok["added_tokens"]:
        types[added["id"]] = 3 if added["special"] else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    ids = {t: i for i, t in enumerate(tokens)}
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "smollm")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", types)
    writer.add_array("tokenizer.ggml.merges", merges)
    writer.add_uint32("tokenizer.ggml.bos_token_id", ids[tok_cfg["bos_token"]])
    writer.add_uint32("tokenizer.ggml.eos_token_id", ids[tok_cfg["eos_token"]])
    writer.add_uint32("tokenizer.ggml.unknown_token_id", ids[tok_cfg["unk_token"]])
    writer.add_uint32("tokenizer.ggml.padding_token_id", ids[tok_cfg["pad_token"]])
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_string("tokenizer.chat_template", tok_cfg["chat_template"])


def _llama3_rope_factors(rope: dict[str, Any], head_dim: int, theta: float) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.generate_extra_tensors, rewritten."""
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_context / high:
            out.append(1.0)
        elif wavelen > old_context / low:
            out.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)
