"""Chunked pipeline parallelism (CPP) in time: how long a prefill group takes for one prompt.

Mooncake (arXiv 2407.00079 v3 §5.1, FAST'25 §3.3) groups X prefill nodes into a pipeline: each
holds a contiguous range of the model's layers (a stage), a long prompt is cut into chunks of at
most ``chunk_tokens``, and chunk k runs on stage s while chunk k+1 runs on stage s-1 (TeraPipe);
stages talk only at their boundaries (one chunk's hidden states). Prompts whose uncached part
fits one chunk go through the stages in one piece.

Times come from the whole model's prefill time ``prefill_s(new, cached)`` (the cost model's, or
the Conductor's fitted model). Chunk k, the new tokens ``done_k`` to ``done_k + n_k``, costs the
whole model what it adds: ``prefill_s(done_k + n_k, cached) - prefill_s(done_k, cached)`` (the
first chunk with the fixed overhead), so the chunks of a prompt add up to its unchunked prefill
and later chunks, whose attention spans more tokens, cost more; a group is compared with a single
instance doing the same work. A stage holds 1/stages of the layers, so a chunk costs it 1/stages
of that; its hidden states then cross to the next stage (``hop_s(tokens)``). A stage works on one
chunk at a time, in arrival order, so with ``free`` (when each stage is next idle) the same
recurrence also places a request behind the chunks of the ones before it: a group starts the
next prompt's first chunk while the last one's final chunks are still in its later stages.

    finish[s][k] = max(finish[s-1][k] + hop(k), finish[s][k-1], free[s]) + chunk_s(k) / stages
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineShape:
    """A prefill unit: ``stages`` nodes in a pipeline (1: a single instance) and the largest
    chunk a long prompt is cut into (the papers' ``prefill_chunk``)."""

    stages: int = 1
    chunk_tokens: int = 4096

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise ValueError(f"stages must be >= 1, got {self.stages}")
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")


SINGLE = PipelineShape()


def chunks(new_tokens: int, cached_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """(new, cached before it) for each chunk of a prefill of ``new_tokens`` after
    ``cached_tokens``: one chunk when the new tokens fit, else pieces of ``chunk_tokens`` (the
    last one shorter)."""
    if new_tokens <= 0:
        return []
    out = []
    done = 0
    while done < new_tokens:
        n = min(chunk_tokens, new_tokens - done)
        out.append((n, cached_tokens + done))
        done += n
    return out


def chunk_times(
    prefill_s: Callable[[int, int], float], new_tokens: int, cached_tokens: int, chunk_tokens: int
) -> list[tuple[int, float]]:
    """(tokens, whole-model seconds) of each chunk: what it adds to the prefill (above)."""
    out = []
    before = 0.0
    for n, p in chunks(new_tokens, cached_tokens, chunk_tokens):
        upto = prefill_s(p - cached_tokens + n, cached_tokens)
        out.append((n, max(0.0, upto - before)))
        before = upto
    return out


def stage_plan(
    prefill_s: Callable[[int, int], float],
    hop_s: Callable[[int], float],
    new_tokens: int,
    cached_tokens: int,
    shape: PipelineShape,
) -> tuple[list[float], list[float]]:
    """(each chunk's seconds on one stage, each chunk's hop seconds) on a group."""
    parts = chunk_times(prefill_s, new_tokens, cached_tokens, shape.chunk_tokens)
    return [t / shape.stages for _, t in parts], [hop_s(n) for n, _ in parts]


def run_pipeline(
    chunk_s: Sequence[float], hop_s: Sequence[float], free: Sequence[float], start: float
) -> tuple[float, list[float]]:
    """The recurrence above for one request entering at ``start``: ``chunk_s[k]`` the time of
    chunk k on one stage, ``hop_s[k]`` its hidden states' crossing between two stages, ``free[s]``
    when stage s is next idle. Returns when the last stage ends the last chunk, and each stage's
    new idle time."""
    stages = len(free)
    prev = [start] * len(chunk_s)  # when chunk k is ready to enter the current stage
    new_free = list(free)
    for s in range(stages):
        t = new_free[s]
        ends = []
        for k, c in enumerate(chunk_s):
            ready = prev[k] + (hop_s[k] if s > 0 else 0.0)
            t = max(t, ready) + c
            ends.append(t)
        new_free[s] = t
        prev = ends
    return (prev[-1] if chunk_s else start), new_free


def pipelined_prefill_s(
    prefill_s: Callable[[int, int], float],
    hop_s: Callable[[int], float],
    new_tokens: int,
    cached_tokens: int,
    shape: PipelineShape,
) -> tuple[float, float]:
    """An idle group's prefill of ``new_tokens`` after ``cached_tokens``: (seconds until the
    last stage ends it, seconds each stage is busy with it). A single instance (one stage) runs
    the whole prompt as one piece: (prefill_s(new, cached), the same)."""
    if new_tokens <= 0:
        return 0.0, 0.0
    if shape.stages == 1:
        t = prefill_s(new_tokens, cached_tokens)
        return t, t
    per, hops = stage_plan(prefill_s, hop_s, new_tokens, cached_tokens, shape)
    end, _ = run_pipeline(per, hops, [0.0] * shape.stages, 0.0)
    return end, sum(per)
