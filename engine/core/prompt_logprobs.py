"""Prompt logprobs (vLLM's ``prompt_logprobs``): for every prompt token after the first, its
logprob given the tokens before it, its rank in the vocabulary, and the top-k alternatives.

They come from the hidden states of the prefill chunks as the scheduler runs them: the row of
position p predicts token p + 1, so a chunk over positions [s, s + n) yields the entries of
tokens s + 1 .. s + n (the last prompt position predicts the first output token, not a prompt
token). Values are the model's raw distribution (log_softmax of the logits, no temperature or
penalties), as vLLM reports them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from engine.core.request import Request
from engine.outputs import Logprob

# Positions turned into logits at a time: 256 x 49k float32 logits are 50 MB, a whole 2k-token
# chunk would be 400 MB.
ROWS_PER_SLICE = 256


class SliceLogprobs(NamedTuple):
    """One slice of positions' entries, in host memory."""

    chosen: torch.Tensor  # [n] the logprob of each target token
    ranks: torch.Tensor  # [n] its rank (1: the most likely)
    top_values: torch.Tensor  # [n, k] the k best logprobs, best first
    top_ids: torch.Tensor  # [n, k] their token ids


def slice_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> SliceLogprobs:
    """The entries of rows ``logits`` [n, vocab] (on the model's device) predicting ``targets``,
    computed where the logits are and copied to host memory once per tensor."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(targets, dtype=torch.long).to(logprobs.device)
    chosen = logprobs.gather(1, index[:, None])
    ranks = (logprobs > chosen).sum(dim=1) + 1
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (chosen[:, :0], index[:, None][:, :0])
    return SliceLogprobs(chosen[:, 0].cpu(), ranks.cpu(), top_values.cpu(), top_ids.cpu())


class PromptRows(NamedTuple):
    """Rows of one step's flat batch whose logits give prompt logprobs of ``request``."""

    request: Request
    first_row: int  # row of position ``first_position`` in the flat batch
    first_position: int
    count: int


def rows_wanted(order, lens: list[int]) -> list[PromptRows]:
    """The prompt-logprob rows of a step. ``order``: the scheduled requests in flat-batch order
    (before the step advances them); ``lens``: their token counts."""
    out, row = [], 0
    for s, n in zip(order, lens):
        req = s.request
        start = req.num_computed_tokens
        if req.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
            count = min(start + n, req.num_prompt_tokens - 1) - start
            out.append(PromptRows(req, row, start, count))
        row += n
    return out


@torch.inference_mode()
def fill_prompt_logprobs(
    wanted: list[PromptRows],
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    token_text: Callable[[int], str],
) -> None:
    """Write each request's entries for the tokens its rows predict."""
    for w in wanted:
        req, k = w.request, w.request.params.prompt_logprobs
        for lo in range(0, w.count, ROWS_PER_SLICE):
            n = min(ROWS_PER_SLICE, w.count - lo)
            rows = hidden[w.first_row + lo : w.first_row + lo + n]
            pos = w.first_position + lo
            targets = req.prompt_token_ids[pos + 1 : pos + 1 + n]
            got = slice_logprobs(compute_logits(rows), targets, k)
            top_v, top_i = got.top_values.tolist(), got.top_ids.tolist()
            for j, (t, v, r) in enumerate(zip(targets, got.chosen.tolist(), got.ranks.tolist())):
                entry = {
                    tid: Logprob(val, rank, token_text(tid))
                    for rank, (tid, val) in enumerate(zip(top_i[j], top_v[j]), start=1)
                }
                entry[t] = Logprob(v, r, token_text(t))
                req.prompt_logprobs[pos + 1 + j] = entry
