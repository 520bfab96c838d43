"""SequenceGrammar and a step's bitmask on the default model's tokenizer: a matcher accepts what
its grammar allows and refuses the rest unchanged, replays a sequence's tokens, terminates on the
stop token; ``step_bitmask`` is None without a live grammar and all ones on unconstrained rows;
``apply_bitmask`` sets exactly the disallowed logits of the listed rows to -inf, as xgrammar's own
kernel does."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import smollm2_tokenizer

from engine.structured.compiler import GrammarCompiler
from engine.structured.grammar import SequenceGrammar, apply_bitmask, step_bitmask
from engine.structured.params import StructuredOutputs

VOCAB = 49152


@pytest.fixture(scope="module")
def setup():
    tok = smollm2_tokenizer()
    compiler = GrammarCompiler(tok, VOCAB)
    yield tok, compiler
    compiler.close()


def grammar(setup, **so) -> SequenceGrammar:
    return SequenceGrammar(setup[1].compile(StructuredOutputs(**so)))


def allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    out = set()
    for word_index, word in enumerate(bitmask[row].tolist()):
        for bit in range(32):
            if (word >> bit) & 1:
                out.add(word_index * 32 + bit)
    return {t for t in out if t < VOCAB}


def test_accept_refuse_replay_terminate(setup):
    tok, _ = setup
    eos = tok.eos_token_ids[0]
    g = grammar(setup, choice=["yes", "no"])
    (no,) = tok.encode("no")
    (hello,) = tok.encode("hello")
    assert not g.accept(hello)  # refused, state unchanged
    assert not g.completed and not g.terminated
    assert g.accept(no)
    assert g.completed and not g.terminated
    assert not g.accept(hello)  # nothing may follow but the stop token
    assert g.accept(eos) and g.terminated

    # A fresh matcher fed the same tokens ends in the same state; a bad token stops a replay.
    h = grammar(setup, choice=["yes", "no"])
    assert h.replay([no]) and h.completed
    assert not grammar(setup, choice=["yes", "no"]).replay([no, hello])


def test_step_bitmask_constrains_only_live_grammar_rows(setup):
    tok, _ = setup
    assert step_bitmask([None, None], VOCAB) is None
    done = grammar(setup, choice=["no"])
    done.replay([*tok.encode("no"), tok.eos_token_ids[0]])
    assert done.terminated
    assert step_bitmask([None, done], VOCAB) is None  # a terminated grammar masks nothing

    digits = grammar(setup, regex="[0-9]{2}")
    bitmask, rows = step_bitmask([None, digits, None], VOCAB)
    assert rows == [1]
    assert bitmask.shape == (3, math.ceil(VOCAB / 32)) and bitmask.dtype == torch.int32
    assert bool((bitmask[0] == -1).all()) and bool((bitmask[2] == -1).all())
    ok = allowed(bitmask, 1)
    assert ok and all(tok.decode([t]).isdigit() for t in ok)
    assert set(tok.encode("7")) <= ok and not (set(tok.encode("a")) & ok)


def test_apply_bitmask_masks_exactly_the_disallowed_tokens_of_listed_rows(setup):
    digits = grammar(setup, regex="[0-9]{2}")
    bitmask, rows = step_bitmask([None, digits], VOCAB)
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    masked = logits.clone()
    apply_bitmask(masked, bitmask, rows)
    assert torch.equal(masked[0], logits[0])  # the unconstrained row is untouched
    ok = torch.zeros(VOCAB, dtype=torch.bool)
    ok[sorted(allowed(bitmask, 1))] = True
    assert torch.equal(masked[1][ok], logits[1][ok])
    assert bool(torch.isneginf(masked[1][~ok]).all())


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 3], [2]])
def test_apply_bitmask_equals_xgrammars_kernel(rows):
    import xgrammar as xgr

    g = torch.Generator().manual_seed(len(rows))
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, math.ceil(VOCAB / 32)), generator=g)
    bitmask = bitmask.to(torch.int32)
    bitmask[0, :100] = 0  # a row that allows almost nothing there
    logits = torch.randn(4, VOCAB, generator=g)
    ours, theirs = logits.clone(), logits.clone()
    apply_bitmask(ours, bitmask, rows)
    xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=VOCAB, indices=rows)
    assert torch.equal(ours, theirs)
    assert bool(torch.isneginf(ours[rows]).any())


def test_drafts_valid_prefix_and_their_rows_masks(setup):
    """``valid_prefix`` counts the drafts a grammar accepts in a row and leaves the matcher as
    it was; ``draft_bitmask`` gives row j the mask after the first j drafts (as a matcher fed
    them one by one gives), leaves the matcher as it was, and leaves rows without a grammar out."""
    from engine.structured.grammar import draft_bitmask

    tok, _ = setup
    eos = tok.eos_token_ids[0]
    so = {"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}
    good = tok.encode('{"a": 12}')
    g = grammar(setup, **so)
    assert g.valid_prefix([*good, eos, eos]) == len(good) + 1  # nothing after it terminates
    assert g.valid_prefix([*good[:2], tok.encode("hello")[0], *good[2:]]) == 2
    assert not g.completed and g.replay(good) and g.completed  # unchanged by the checks
    g = grammar(setup, **so)
    drafts = good[:3]
    bitmask, rows = draft_bitmask([None, g], [[5, 6], drafts], VOCAB)
    assert rows == [3, 4, 5, 6]  # the unconstrained sequence's three rows are not listed
    step = grammar(setup, **so)
    for j in range(len(drafts) + 1):
        want, _ = step_bitmask([step], VOCAB)
        assert allowed(bitmask, 3 + j) == allowed(want, 0)
        if j < len(drafts):
            assert step.accept(drafts[j])
    assert g.replay(good) and g.completed  # the matcher was rolled back
