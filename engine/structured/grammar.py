"""A sequence's place in its grammar, and the token bitmask of a step's constrained rows.

Each constrained sequence (each choice of an ``n > 1`` request) has its own matcher, advanced
with every token it samples. The matcher's state is a function of the sequence's output tokens
alone, so it needs no saving: a preempted sequence keeps its output tokens and its matcher, and
an engine that continues a sequence another engine started (a decode worker taking a prefill
worker's first token) builds a matcher and feeds it the tokens so far (``SequenceGrammar.replay``).
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Sequence

import torch


class SequenceGrammar:
    """One sequence's matcher. ``accept`` returns False for a token the grammar does not allow
    (the matcher is then unchanged); ``terminated`` once it accepted a stop token."""

    def __init__(self, compiled) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)

    def accept(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(token_id))

    def replay(self, token_ids: Sequence[int]) -> bool:
        return all(self.accept(t) for t in token_ids)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (speculative drafts)."""
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many of ``token_ids`` the grammar accepts in a row from here (nothing after it
        terminates); the matcher is left as it was."""
        n = 0
        for t in token_ids:
            if self.terminated or not self.accept(t):
                break
            n += 1
        self.rollback(n)
        return n

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    @property
    def completed(self) -> bool:
        """The output so far is a whole match (only a stop token may follow, or more)."""
        return bool(self.matcher.is_completed())


def step_bitmask(
    grammars: Sequence[SequenceGrammar | None], vocab_size: int
) -> tuple[torch.Tensor, list[int]] | None:
    """The int32 bitmask [rows, ceil(vocab/32)] of a step (all ones on rows without a grammar)
    and the rows that have one; None when no row has. Each row costs its matcher microseconds:
    the masks of a grammar's states are precomputed when it compiles."""
    rows = [i for i, g in enumerate(grammars) if g is not None and not g.terminated]
    if not rows:
        return None
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(grammars), vocab_size)
    for i in rows:
        grammars[i].matcher.fill_next_token_bitmask(bitmask, i)
    return bitmask, rows


def draft_bitmask(
    grammars: Sequence[SequenceGrammar | None],
    drafts: Sequence[Sequence[int]],
    vocab_size: int,
) -> tuple[torch.Tensor, list[int]] | None:
    """The bitmask of a step whose sequences verify drafts: sequence ``i`` has
    ``len(drafts[i]) + 1`` rows, row ``j`` masked by the grammar's state after the sequence's
    first ``j`` drafts (which its grammar accepts: SpecDecoder keeps only such). The matchers
    are left as they were. None when no sequence has a grammar."""
    if all(g is None or g.terminated for g in grammars):
        return None
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(sum(len(d) + 1 for d in drafts), vocab_size)
    rows, row = [], 0
    for g, d in zip(grammars, drafts, strict=True):
        if g is None or g.terminated:
            row += len(d) + 1
            continue
        taken = 0
        for j in range(len(d) + 1):
            if g.terminated:  # a draft ended it: the rows after it are never kept
                break
            g.matcher.fill_next_token_bitmask(bitmask, row + j)
            rows.append(row + j)
            if j < len(d):
                if not g.accept(d[j]):
                    raise ValueError(f"draft token {d[j]} is not allowed by its grammar")
                taken += 1
        g.rollback(taken)
        row += len(d) + 1
    return bitmask, rows


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the logits of the tokens a row's grammar does not allow to -inf, in place, on the
    listed rows only (float32 [rows, vocab]). On a GPU xgrammar's kernel does it. On the CPU the
    rows' bits become a bool mask through a byte table and one ``masked_fill_``: xgrammar's CPU
    kernel writes each disallowed token in turn, ~0.2 ms a row where a grammar allows few tokens
    (most JSON states), the table ~0.03 ms (a batch of 16 JSON rows: 2.0 against 0.4 ms a step)."""
    if logits.device.type != "cpu" or sys.byteorder != "little":
        import xgrammar as xgr

        if bitmask.device != logits.device:
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)
        return
    everyone = rows == list(range(logits.shape[0])) and bitmask.shape[0] == len(rows)
    words = bitmask if everyone else bitmask.index_select(0, torch.tensor(rows))
    flat = words.contiguous().view(torch.uint8).view(-1).int()  # little-endian: token order
    banned = _banned_bits().index_select(0, flat).view(len(rows), -1)[:, : logits.shape[1]]
    if everyone:
        logits.masked_fill_(banned, -math.inf)
    else:
        for j, i in enumerate(rows):
            logits[i].masked_fill_(banned[j], -math.inf)


@functools.cache
def _banned_bits() -> torch.Tensor:
    """[256, 8] bool: entry (b, i) is True where bit i of byte b is clear."""
    byte = torch.arange(256, dtype=torch.int32).unsqueeze(1)
    return (byte >> torch.arange(8, dtype=torch.int32)) & 1 == 0
