"""What a format reader (gguf_loader.py, hf_loader.py) hands the model loader: the model's config,
its tokenizer, and where each tensor is, before any is read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.config import ModelConfig
from engine.model.tokenizer import Tokenizer


class TensorSource(NamedTuple):
    """Where one weight is: ``file`` and ``name`` as stored there, its shape in HF layout, and how
    to read it (a float tensor in HF layout, any float dtype)."""

    file: str
    name: str
    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]


@dataclass(frozen=True)
class Checkpoint:
    """What a format reader hands back: nothing is read from the tensors yet."""

    config: ModelConfig
    tokenizer: Tokenizer
    tensors: dict[str, TensorSource]  # HF name -> source
    location: str  # the file (or directory of shards) a missing tensor should be in
