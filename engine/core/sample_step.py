"""The forward of a step that samples (the whole model, or the last stage of a pipeline): the
logits of the rows that sample, prompt logprobs where asked, the grammars' token masks, then the
vectorised sampler."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from engine.core.model_runner import ModelRunner, StepInputs
from engine.core.output_processor import StepResult
from engine.core.prompt_logprobs import fill_prompt_logprobs, rows_wanted
from engine.core.sampler import Sampler, SamplingBatch, is_greedy
from engine.core.step_clock import step_clock
from engine.model.llama import LayerHook
from engine.spec.verify import accept, draft_rows, mark_generators, rewind
from engine.structured.grammar import draft_bitmask, step_bitmask


class SampleStep:
    """``token_text`` names a token for prompt logprobs' alternatives; ``sampler`` is public so
    that a test can watch the batches it gets."""

    def __init__(
        self,
        runner: ModelRunner,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        device: torch.device,
        token_text: Callable[[int], str],
    ) -> None:
        self.runner, self.compute_logits, self.token_text = runner, compute_logits, token_text
        self.vocab_size, self.eos_token_ids, self.device = vocab_size, eos_token_ids, device
        self.sampler = Sampler()

    def run(
        self, inputs: StepInputs, hook: LayerHook | None, hidden_in: torch.Tensor | None
    ) -> StepResult:
        wanted = rows_wanted(inputs.order, [s.num_tokens for s in inputs.order])
        if wanted:
            step = self.runner.execute_with_hidden(inputs, hook, hidden=hidden_in)
            logits = step.logits
            fill_prompt_logprobs(wanted, step.hidden, self.compute_logits, self.token_text)
            del step
        else:
            logits = self.runner.execute(inputs, hook, hidden=hidden_in)
        del hidden_in
        forward_done = step_clock(self.device)
        if any(s.spec_tokens for s in inputs.order):
            return self._verify(logits, inputs, forward_done)
        sampling = [s.request for s in inputs.order if s.samples]
        grammars = [r.grammar for r in sampling]
        bitmask = None
        if any(g is not None for g in grammars):
            bitmask = step_bitmask(grammars, self.vocab_size)
        batch = SamplingBatch.build(
            [r.params for r in sampling],
            [r.generator for r in sampling],
            [r.prompt_token_ids for r in sampling],
            [r.output_token_ids for r in sampling],
            self.vocab_size,
            self.device,
            eos_token_ids=self.eos_token_ids,
            bitmask=bitmask,
        )
        sampled = self.sampler(logits, batch)  # its .tolist() waits for the device
        return StepResult(
            sampling, sampled.token_ids, sampled.logprobs, forward_done, time.perf_counter()
        )

    def _verify(self, logits: torch.Tensor, inputs: StepInputs, forward_done: float) -> StepResult:
        """A step with drafts (engine/spec/verify.py): every row of a sequence with drafts is
        sampled as decoding samples its position, then each sequence keeps its drafts up to
        the first the sampled tokens disagree with, and one sampled token more."""
        sampling = [s for s in inputs.order if s.samples]
        rows = draft_rows([s.request for s in sampling], [s.spec_tokens for s in sampling])
        row_reqs, outputs = rows.per_row()
        bitmask = None
        if any(r.grammar is not None for r in rows.requests):
            grammars = [r.grammar for r in rows.requests]
            bitmask = draft_bitmask(grammars, rows.drafts, self.vocab_size)
        batch = SamplingBatch.build(
            [r.params for r in row_reqs],
            [r.generator for r in row_reqs],
            [r.prompt_token_ids for r in row_reqs],
            outputs,
            self.vocab_size,
            self.device,
            eos_token_ids=self.eos_token_ids,
            bitmask=bitmask,
        )
        marks = mark_generators(rows, [not is_greedy(r.params) for r in rows.requests])
        sampled = self.sampler(logits, batch)
        verified = accept(rows, sampled.token_ids, sampled.logprobs)
        for i, mark in marks.items():
            if verified.emitted[i] < len(rows.drafts[i]) + 1:  # rows past a mismatch drew too
                rewind(mark, verified.emitted[i], self.vocab_size, self.device)
        return StepResult(
            verified.requests,
            verified.tokens,
            verified.logprobs,
            forward_done,
            time.perf_counter(),
            verified.drafts(rows),
        )
