"""The sampling side of a step with drafts, and the accept rule.

A sequence verifying ``d`` drafts has ``d + 1`` rows of logits: row ``j`` is the model's
distribution for the token after its last token and its first ``j`` drafts. Each row is sampled
as decoding would sample that position (its penalties and ``min_tokens`` see the drafts before
it as output, its grammar mask is the state after them, a seeded sequence draws from its own
generator, row after row). Then, in order, the sampled token is kept; if it equals the row's draft
the next row is looked at, otherwise (or after the last row) the sequence stops there. So a step
keeps ``a`` drafts (those equal to what was sampled) and one token of the model's own.

Why this is exact: a draft is one token, not a distribution (the proposers are draftless), so
rejection sampling with a point-mass draft accepts draft ``x`` with probability ``p(x)`` and on
rejection samples from ``p`` without ``x``, renormalised. Sampling ``t ~ p`` and keeping the
draft when ``t == x`` does the same: ``t == x`` with probability ``p(x)``, and otherwise ``t`` is
distributed as ``p`` conditioned on ``t != x``. Every token kept is a draw from the model's own
distribution at its position; greedy rows keep the argmax. A seeded sequence draws, for its
``k``-th output token, the generator's ``k``-th draw, as without speculation (the draws of rows
past the first mismatch are taken back: ``rewind``), so with batch-invariant logits its tokens
and logprobs are those of decoding without drafts, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine.core.request import Request
from engine.outputs import TokenLogprob


class DraftRows(NamedTuple):
    """The sampling rows of a step, sequence by sequence: ``requests[i]`` has rows
    ``starts[i] .. starts[i] + len(drafts[i])``."""

    requests: list[Request]
    drafts: list[list[int]]
    starts: list[int]

    @property
    def num_rows(self) -> int:
        return self.starts[-1] + len(self.drafts[-1]) + 1 if self.requests else 0

    def per_row(self) -> tuple[list[Request], list[list[int]]]:
        """Each row's request and the output it sees (the request's output and the drafts
        before the row)."""
        reqs, outputs = [], []
        for req, d in zip(self.requests, self.drafts, strict=True):
            for j in range(len(d) + 1):
                reqs.append(req)
                outputs.append(req.output_token_ids + d[:j] if j else req.output_token_ids)
        return reqs, outputs


def draft_rows(requests: Sequence[Request], drafts: Sequence[Sequence[int]]) -> DraftRows:
    starts, row = [], 0
    for d in drafts:
        starts.append(row)
        row += len(d) + 1
    return DraftRows(list(requests), [list(d) for d in drafts], starts)


class GeneratorMark(NamedTuple):
    generator: torch.Generator
    state: torch.Tensor


def mark_generators(rows: DraftRows, is_random: Sequence[bool]) -> dict[int, GeneratorMark]:
    """The state before sampling of each seeded, random sequence with drafts (by index)."""
    marks = {}
    for i, (req, d) in enumerate(zip(rows.requests, rows.drafts, strict=True)):
        if d and is_random[i] and req.generator is not None:
            marks[i] = GeneratorMark(req.generator, req.generator.get_state())
    return marks


def rewind(mark: GeneratorMark, draws: int, vocab_size: int, device) -> None:
    """Leave the generator as if it had drawn only ``draws`` rows since ``mark`` (a row's draw is
    ``vocab_size`` uniforms: engine/core/sampler.py)."""
    mark.generator.set_state(mark.state)
    scratch = torch.empty(vocab_size, device=device)
    for _ in range(draws):
        scratch.uniform_(generator=mark.generator)


class Verified(NamedTuple):
    """A step's tokens, flat and in order (a request once per token it gets), and how many
    tokens each sequence of the DraftRows got (its kept drafts and one more)."""

    requests: list[Request]
    tokens: list[int]
    logprobs: list[TokenLogprob | None]
    emitted: list[int]

    def drafts(self, rows: DraftRows) -> list[tuple[Request, int, int]]:
        """(request, drafts proposed, drafts kept) of each sequence that had drafts."""
        return [
            (req, len(d), n - 1)
            for req, d, n in zip(rows.requests, rows.drafts, self.emitted, strict=True)
            if d
        ]


def accept(
    rows: DraftRows, tokens: Sequence[int], logprobs: Sequence[TokenLogprob | None]
) -> Verified:
    """Walk each sequence's rows: keep the sampled token, go on while it equals the draft."""
    out = Verified([], [], [], [])
    for req, d, start in zip(rows.requests, rows.drafts, rows.starts, strict=True):
        n = 0
        for j in range(len(d) + 1):
            t = tokens[start + j]
            out.requests.append(req)
            out.tokens.append(t)
            out.logprobs.append(logprobs[start + j])
            n += 1
            if j == len(d) or t != d[j]:
                break
        out.emitted.append(n)
    return out
