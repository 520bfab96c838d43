"""How many positions a model serves: its own context, a rotary scaling that stretches it
(``--rope-scaling``), and a ``--max-model-len`` past both, served with a warning.

The model's ModelConfig is replaced before the model is built, so the rotary tables, the cache
plan and the length checks all see the one length."""

from __future__ import annotations

import dataclasses

from engine.config import ModelConfig, RopeScaling


def extend_context(
    cfg: ModelConfig, override: RopeScaling | None, max_model_len: int | None
) -> tuple[ModelConfig, str | None]:
    """(the config to build with, a warning or None). The context is the model's
    max_position_embeddings, or what the override's scaling stretches it to (original x factor),
    whichever is longer; ``max_model_len`` past it is allowed and warned about: positions the
    model never saw, where answers degrade (how much is measured per model: docs/serving.md)."""
    scaling = cfg.rope_scaling if override is None else override
    context = cfg.max_position_embeddings
    if override is not None and override.context is not None:
        context = max(context, override.context)
    want = max_model_len or context
    warning = None
    if want > context:
        how = "" if override is not None else " (--rope-scaling can stretch it, e.g. yarn)"
        warning = (
            f"max_model_len {want} is past the model's context of {context} positions{how}: "
            f"positions beyond {context} were never trained, expect answers to degrade there "
            "(repetition, lost facts from the prompt's start)"
        )
    positions = max(context, want)
    if scaling == cfg.rope_scaling and positions == cfg.max_position_embeddings:
        return cfg, warning
    return (
        dataclasses.replace(cfg, rope_scaling=scaling, max_position_embeddings=positions),
        warning,
    )
