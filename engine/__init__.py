"""A KVCache-centric LLM serving engine. ``from engine import LLM, SamplingParams``."""

from __future__ import annotations

from engine import cpu_isa as _cpu_isa

# Before anything imports torch: ENGINE_CPU_ISA caps torch, oneDNN and MKL through variables they
# read once (engine/cpu_isa.py). An invalid value fails here, naming the variable.
_cpu_isa.apply_to_environment()

from engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.structured.params import StructuredOutputs  # noqa: E402

__all__ = [
    "LLM",
    "AsyncLLM",
    "SamplingParams",
    "StructuredOutputs",
    "RequestOutput",
    "CompletionOutput",
]


def __getattr__(name: str):
    # Heavy imports (torch model code) only when the API is used.
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from engine.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(name)
