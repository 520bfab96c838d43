"""A pipeline stage's part of a step (chunked pipeline parallelism, engine/core/stage_io.py):
the input rows a stage after the first takes from its StageIO, and the forward of a stage short
of the last, which hands its hidden states on instead of sampling."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.core.model_runner import ModelRunner, StepInputs
from engine.core.output_processor import StepResult
from engine.core.scheduler_output import ScheduledRequest
from engine.core.stage_io import StageIO
from engine.core.step_clock import step_clock
from engine.model.llama import LayerHook
from engine.pipeline_stage import PipelineStage


class StageInputs:
    """A later stage's input rows for a step, from its StageIO, checked against the step."""

    def __init__(
        self,
        stage_io: StageIO,
        stage: PipelineStage,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.stage_io, self.stage = stage_io, stage
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device

    def __call__(self, order: Sequence[ScheduledRequest]) -> torch.Tensor:
        hidden = self.stage_io.inputs(order)
        rows = sum(s.num_tokens for s in order)
        want = (rows, self.hidden_size)
        if tuple(hidden.shape) != want or hidden.dtype != self.dtype:
            raise RuntimeError(
                f"StageIO.inputs gave {tuple(hidden.shape)} {hidden.dtype} hidden states, the "
                f"step of stage {self.stage} needs {want} {self.dtype}"
            )
        return hidden.to(self.device)


def no_stage_inputs(order: Sequence[ScheduledRequest]) -> None:
    """The first stage (and the whole model) starts from the token embeddings."""
    return None


class StageStep:
    """The forward of a stage short of the last: no logits, no sampling; the hidden states go to
    the StageIO, and the requests whose prompt ran end STAGE_DONE (their full blocks stay in the
    prefix cache)."""

    def __init__(self, runner: ModelRunner, stage_io: StageIO, device: torch.device) -> None:
        self.runner, self.stage_io, self.device = runner, stage_io, device

    def run(
        self, inputs: StepInputs, hook: LayerHook | None, hidden_in: torch.Tensor | None
    ) -> StepResult:
        hidden = self.runner.execute_hidden(inputs, hook, hidden_in)
        del hidden_in
        self.stage_io.outputs(inputs.order, hidden)
        del hidden
        forward_done = step_clock(self.device)
        done = [s.request for s in inputs.order if s.samples]  # before the counts advance
        return StepResult(done, None, None, forward_done, forward_done)
