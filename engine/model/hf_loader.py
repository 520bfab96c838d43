"""Reading a Hugging Face model directory: config.json, safetensors weights (one file or shards
listed in model.safetensors.index.json, memory-mapped), and the tokenizer (tokenizer.json, or a
SentencePiece tokenizer.model) with its chat template and special tokens.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
from safetensors import safe_open
from tokenizers import Regex, normalizers
from tokenizers import Tokenizer as Backend

from engine.config import ModelConfig, RopeScaling
from engine.model.checkpoint import Checkpoint, TensorSource
from engine.model.tokenizer import (
    Tokenizer,
    add_special_tokens_by_type,
    sentencepiece,
    set_post_processor,
)

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def load_hf_checkpoint(directory: str) -> Checkpoint:
    config_path = os.path.join(directory, "config.json")
    cfg = read_json(config_path)
    config = config_from_hf(cfg, config_path)
    generation = read_json(os.path.join(directory, "generation_config.json"), missing_ok=True)
    tokenizer = load_hf_tokenizer(directory, cfg, generation)
    config = replace(
        config,
        name=os.path.basename(os.path.normpath(directory)),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
    )
    sources, location = safetensors_sources(directory)
    return Checkpoint(config, tokenizer, sources, location)


def read_json(path: str, missing_ok: bool = False) -> dict[str, Any]:
    if not os.path.exists(path):
        if missing_ok:
            return {}
        raise ValueError(f"{path} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON ({exc})") from exc


def config_from_hf(cfg: Mapping[str, Any], path: str) -> ModelConfig:
    """ModelConfig from a config.json dict (``path`` names the file in errors)."""
    names = cfg.get("architectures") or []
    arch = next((ARCHITECTURES[n] for n in names if n in ARCHITECTURES), None)
    if arch is None and not names:
        arch = cfg.get("model_type") if cfg.get("model_type") in ARCHITECTURES.values() else None
    if arch is None:
        found = ", ".join(names) or repr(cfg.get("model_type"))
        raise ValueError(
            f"{path}: unsupported architecture {found}; supported: {', '.join(ARCHITECTURES)}"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{path}: hidden_act {cfg['hidden_act']!r} is not supported (silu)")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{path}: mlp_bias is not supported")
    # Qwen2 always has q/k/v biases; elsewhere attention_bias also puts one on o_proj.
    if arch != "qwen2" and cfg.get("attention_bias"):
        raise ValueError(f"{path}: attention_bias (with an o_proj bias) is not supported")

    def need(key: str) -> Any:
        if cfg.get(key) is None:
            raise ValueError(f"{path}: {key} is missing")
        return cfg[key]

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    sliding = cfg.get("sliding_window")
    if arch in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        sliding = None
    theta, scaling = rope_from_hf(cfg, path)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        max_position_embeddings=int(need("max_position_embeddings")),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        sliding_window=int(sliding) if sliding else None,
    )


def rope_from_hf(cfg: Mapping[str, Any], path: str) -> tuple[float, RopeScaling]:
    """(rope_theta, scaling) from transformers 4 keys (rope_theta, rope_scaling) or transformers 5
    ``rope_parameters`` (which holds rope_theta too)."""
    params = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    model_max = int(cfg.get("max_position_embeddings", 8192))
    return theta, RopeScaling.from_dict(params, model_max, path)


def safetensors_sources(directory: str) -> tuple[dict[str, TensorSource], str]:
    """Every tensor in the directory's safetensors files, by name (only headers are read), and
    where a missing tensor should have been, for errors."""
    index_path = os.path.join(directory, "model.safetensors.index.json")
    weight_map: dict[str, str] = {}
    if os.path.exists(index_path):
        weight_map = read_json(index_path).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        for file in files:
            if not os.path.exists(os.path.join(directory, file)):
                raise ValueError(
                    f"{os.path.join(directory, file)} (listed in {index_path}) is missing"
                )
        location = f"{directory} ({len(files)} safetensors files)"
    else:
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
        if not files:
            raise ValueError(f"{os.path.join(directory, 'model.safetensors')} is missing")
        location = os.path.join(directory, files[0]) if len(files) == 1 else directory
    handles: dict[str, Any] = {}  # one open (memory-mapped) file per shard while loading

    def reader(file: str, name: str) -> Callable[[], torch.Tensor]:
        def load() -> torch.Tensor:
            if file not in handles:
                handles[file] = safe_open(os.path.join(directory, file), framework="pt")
            return handles[file].get_tensor(name)

        return load

    sources = {}
    for file in files:
        with safe_open(os.path.join(directory, file), framework="pt") as f:
            for name in f.keys():
                shape = tuple(f.get_slice(name).get_shape())
                sources[name] = TensorSource(file, name, shape, reader(file, name))
    for name, file in weight_map.items():
        if name not in sources:
            raise ValueError(f"{file}: missing tensor {name} (the index lists it there)")
    return sources, location


def load_hf_tokenizer(
    directory: str, cfg: Mapping[str, Any], generation: Mapping[str, Any]
) -> Tokenizer:
    """Tokenizer from tokenizer.json (or tokenizer.model), tokenizer_config.json, and the ids in
    generation_config.json / config.json (generation_config first, as transformers does)."""
    tok_cfg = read_json(os.path.join(directory, "tokenizer_config.json"), missing_ok=True)
    json_path = os.path.join(directory, "tokenizer.json")
    spm_path = os.path.join(directory, "tokenizer.model")
    if os.path.exists(json_path):
        backend = Backend.from_file(json_path)
    elif os.path.exists(spm_path):
        backend = sentencepiece_model_file(spm_path)
    else:
        raise ValueError(f"{directory}: no tokenizer.json or tokenizer.model")

    def spelled(key: str) -> str | None:
        value = tok_cfg.get(key)
        return value.get("content") if isinstance(value, dict) else value

    if "add_bos_token" in tok_cfg or "add_eos_token" in tok_cfg:
        # As transformers does: explicit flags rebuild the post-processor.
        set_post_processor(
            backend,
            spelled("bos_token") if tok_cfg.get("add_bos_token") else None,
            spelled("eos_token") if tok_cfg.get("add_eos_token") else None,
        )

    def ids(key: str) -> list[int]:
        for source in (generation, cfg):
            value = source.get(key)
            if value is not None:
                return list(value) if isinstance(value, list) else [value]
        token = spelled(key.replace("_id", ""))
        index = backend.token_to_id(token) if token else None
        return [index] if index is not None else []

    bos = ids("bos_token_id")
    specials = {k: spelled(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    return Tokenizer(
        backend,
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=ids("eos_token_id"),
        chat_template=_chat_template(directory, tok_cfg),
        special_tokens={k: v for k, v in specials.items() if v is not None},
    )


def _chat_template(directory: str, tok_cfg: Mapping[str, Any]) -> str | None:
    # transformers >= 4.50 saves the template beside tokenizer_config.json, and prefers it.
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.exists(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates; the runtime uses the default one
        template = {t.get("name"): t.get("template") for t in template}.get("default")
    return template


def sentencepiece_model_file(path: str) -> Backend:
    """A tokenizers backend from a SentencePiece ``tokenizer.model`` (a ModelProto), read with a
    small protobuf reader so that neither protobuf nor transformers is needed."""
    with open(path, "rb") as f:
        fields = _proto_fields(f.read())
    tokens, scores, types = [], [], []
    for body in fields.get(1, []):  # ModelProto.pieces: piece=1, score=2, type=3
        piece = _proto_fields(body)
        tokens.append(piece[1][0].decode("utf-8"))
        scores.append(struct.unpack("<f", piece[2][0])[0] if 2 in piece else 0.0)
        types.append(piece[3][0] if 3 in piece else 1)
    trainer = _proto_fields(fields[2][0]) if 2 in fields else {}
    norm = _proto_fields(fields[3][0]) if 3 in fields else {}
    model_type = trainer.get(3, [1])[0]  # UNIGRAM=1, BPE=2
    if model_type not in (1, 2):
        raise ValueError(f"{path}: SentencePiece model type {model_type} is not supported")
    pre = []
    charsmap = norm.get(2, [b""])[0]
    if charsmap:  # nmt_nfkc and friends: the normalization rules sentencepiece compiled
        pre.append(normalizers.Precompiled(charsmap))
    if norm.get(4, [1])[0]:  # remove_extra_whitespaces
        pre += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    unk = next((t for t, k in zip(tokens, types) if k == 2), None)
    backend = sentencepiece(
        tokens,
        scores,
        types,
        unk_token=unk,
        add_space_prefix=bool(norm.get(3, [1])[0]),
        unigram=model_type == 1,
        pre_normalizers=pre,
    )
    add_special_tokens_by_type(backend, tokens, types)
    return backend


def _proto_fields(data: bytes) -> dict[int, list[Any]]:
    """field number -> values (ints for varints, bytes otherwise) of one protobuf message."""
    fields: dict[int, list[Any]] = {}
    pos = 0

    def varint() -> int:
        nonlocal pos
        value = shift = 0
        while True:
            byte = data[pos]
            pos += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    while pos < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            value: Any = varint()
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, pos = data[pos : pos + size], pos + size
        elif wire == 2:
            size = varint()
            value, pos = data[pos : pos + size], pos + size
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        fields.setdefault(number, []).append(value)
    return fields
