"""An engine's runtime model: the checkpoint's config and tokenizer, and its weights, mapped from
the weight cache (engine/model/weight_cache.py) when a usable file is there, else read
(dequantized), fused into the model and written to the cache for the next start.

Only GGUF files are cached: their weights are quantized, so reading them means dequantizing, and
a float copy is what saves the time. A Hugging Face directory's safetensors are float already.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import NamedTuple

import torch

from engine import envs
from engine.config import ModelConfig, RopeScaling
from engine.model import weight_cache
from engine.model.context import extend_context
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import open_checkpoint, read_weights
from engine.model.tokenizer import Tokenizer
from engine.pipeline_stage import WHOLE_MODEL, PipelineStage

logger = logging.getLogger(__name__)


class BuiltModel(NamedTuple):
    config: ModelConfig
    tokenizer: Tokenizer
    path: str  # the model file or directory
    model: LlamaForCausalLM  # in eval mode, weights in place
    cache_file: str | None  # the weight cache file used or written; None: not cached
    cache_hit: bool  # the weights were mapped from cache_file


def build_model(
    model: str,
    dtype: torch.dtype,
    device: torch.device,
    show_progress: bool = False,
    use_cache: bool = True,
    stage: PipelineStage = WHOLE_MODEL,
    rope_override: RopeScaling | None = None,
    max_model_len: int | None = None,
) -> BuiltModel:
    """``model``: "default", a GGUF file or a model directory (see model_loader.load_model).
    ``use_cache=False`` or ENGINE_WEIGHT_CACHE=0 reads the checkpoint every time.

    ``stage``: one stage of a chunked pipeline (engine/pipeline_stage.py): only its weights are read
    from the checkpoint, and it has a weight cache file of its own (holding only them).

    ``rope_override`` and ``max_model_len``: the positions to serve (model/context.py); the
    returned config is the extended one."""
    t0 = time.perf_counter()
    path, checkpoint = open_checkpoint(model)
    config, warning = extend_context(checkpoint.config, rope_override, max_model_len)
    if warning:
        logger.warning(warning)
    checkpoint = dataclasses.replace(checkpoint, config=config)
    net = LlamaForCausalLM(checkpoint.config, dtype, device, stage)
    directory = envs.weight_cache_dir() if use_cache and os.path.isfile(path) else None
    file = key = None
    if directory is not None:
        key = weight_cache.cache_key(path, dtype, stage)
        file = weight_cache.cache_file(directory, path, dtype, key, stage)
        cached = weight_cache.load(file, key, net.runtime_weights())
        if cached:
            net.adopt_weights(cached)
            net.eval()
            logger.info("weights mapped from %s in %.2f s", file, time.perf_counter() - t0)
            return BuiltModel(checkpoint.config, checkpoint.tokenizer, path, net, file, True)
    weights = read_weights(checkpoint, path, dtype, device, show_progress, stage)
    net.load_weights(weights, source=path)
    del weights
    net.eval()
    if file is not None and key is not None:
        if weight_cache.save(file, key, net.runtime_weights()):
            logger.info("weights cached in %s for the next start", file)
        else:
            file = None
    logger.info("weights read from %s in %.2f s", path, time.perf_counter() - t0)
    return BuiltModel(checkpoint.config, checkpoint.tokenizer, path, net, file, False)
