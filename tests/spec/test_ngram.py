"""Prompt lookup: the longest n-gram first, its latest earlier occurrence, never the sequence's
own suffix, at most k tokens and none past the end; the index grows with the sequence."""

from __future__ import annotations

import pytest

from engine.spec.ngram import NgramProposer


def propose(tokens, k=5, lo=2, hi=4):
    p = NgramProposer(lo, hi)
    return p.propose(p.new_state(), tokens, k)


def test_the_tokens_after_the_latest_earlier_occurrence():
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 7, 1, 2, 3]
    assert propose(tokens) == [8, 7, 1, 2, 3]  # after the occurrence at 4..6, not at 0..2


def test_the_longest_n_gram_wins():
    # [2, 3] last occurs before 6 (at 4..5, followed by 6); [1, 2, 3] only at 0..2 (then 4)
    tokens = [1, 2, 3, 4, 2, 3, 6, 5, 1, 2, 3]
    assert propose(tokens, k=2) == [4, 2]
    assert propose(tokens, k=2, lo=2, hi=2) == [6, 5]


def test_no_match_no_proposal_and_never_the_suffix_itself():
    assert propose([5, 6, 7, 8]) == []
    assert propose([4, 4]) == []  # the only [4, 4] is the suffix itself
    assert propose([4, 4, 4], lo=2, hi=2) == [4]  # [4, 4] at 0..1 is followed by 4


def test_k_caps_and_the_end_of_the_sequence_caps():
    tokens = [1, 2, 3, 4, 5, 1, 2]
    assert propose(tokens, k=2) == [3, 4]
    assert propose(tokens, k=10) == [3, 4, 5, 1, 2]
    assert propose(tokens, k=0) == []


def test_incremental_index_equals_a_fresh_one():
    p = NgramProposer(1, 3)
    state = p.new_state()
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3]
    for end in range(1, len(seq) + 1):
        grown = p.propose(state, seq[:end], 4)
        assert grown == p.propose(p.new_state(), seq[:end], 4), end


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="n-gram sizes"):
        NgramProposer(3, 2)
