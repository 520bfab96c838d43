"""Structured outputs: constraints on what a request generates (a JSON schema, any JSON object, a
regex, a list of choices, a grammar), compiled by xgrammar and applied as a token bitmask in the
sampler. ``params.py`` is the constraint, ``compiler.py`` compiles and caches it, ``grammar.py``
follows one sequence through it and masks a step's logits, ``tools.py`` turns OpenAI tools into
constraints and parses their calls back."""

from engine.structured.params import StructuredOutputs

__all__ = ["StructuredOutputs"]
