"""The seam between a pipeline stage's engine and the stages around it (chunked pipeline
parallelism, engine/pipeline_stage.py): where a stage after the first gets its input hidden states
and where a stage before the last puts its output hidden states. The worker processes and the
transport implement it; LLMEngine(config, stage_io=...) calls it from its step, in its thread.

How a request travels through the stages, by request id (the same on every stage):

- every stage gets ``add_request(prompt, params, request_id=rid, ...)``; stage 0 computes from
  its own prefix-cache hit, and its first output chunk starts there (at
  ``request.num_computed_tokens`` of the first ``outputs`` call). A later stage is told that
  start: ``prefix_tokens=start, prefix_exact=True`` (it must hold exactly that prefix in its own
  cache, or the request ends at once with stop reason "prefix_missing"), and
  ``ready_tokens=start + rows received``, raised (``LLMEngine.set_ready_tokens``) as rows arrive.
- a stage short of the last finishes a request with finish reason "stage_done" once its whole
  prompt ran; the last samples the first token exactly as the whole model does. No stage runs
  past the prompt (the last stage's request then waits for ``hand_over`` or ``abort_request``
  unless its first token ended it).

Rows: a step's scheduled requests come in flat-batch order (``order``); request s has
``s.num_tokens`` rows, prompt positions ``[s.request.num_computed_tokens, + s.num_tokens)``. The
engine never asks for rows past a request's ``ready_tokens``. After a preemption a stage
recomputes from its prefix hit again: ``inputs`` may be asked again for rows it gave before (an
implementation keeps a request's rows until the request ends), and ``outputs`` may hand again
rows it handed before (the same values: the receiver may ignore those it has).

On the last stage a request with ``n > 1`` runs one sequence per choice, named ``rid#i`` (i from
0), all over the same prompt: ``inputs`` maps each child to its parent ``rid``'s rows. Stages
short of the last run one sequence per request whatever ``n`` is (named ``rid``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from engine.core.scheduler_output import ScheduledRequest


class StageIO(ABC):
    @abstractmethod
    def inputs(self, order: Sequence[ScheduledRequest]) -> torch.Tensor:
        """Stages after the first: the step's input hidden states [T, hidden] in the model
        dtype, rows in the flat-batch order of ``order`` (request s's rows are prompt positions
        [s.request.num_computed_tokens, + s.num_tokens)). A child ``rid#i`` of a request with
        n > 1 (last stage) reads its parent ``rid``'s rows."""

    @abstractmethod
    def outputs(self, order: Sequence[ScheduledRequest], hidden: torch.Tensor) -> None:
        """Stages before the last: the step's output hidden states [T, hidden], same order (the
        callee copies what it keeps; the tensor may be reused)."""


def parent_request_id(request_id: str, n: int) -> str:
    """The user request a sequence belongs to: ``rid`` for ``rid#i`` when n > 1."""
    return request_id.rsplit("#", 1)[0] if n > 1 else request_id
