"""A KVCache-centric LLM serving engine. ``from engine import LLM, SamplingParams``."""

from __future__ import annotations

from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # Heavy imports (torch model code) only when the API is used.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from engine.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(name)
