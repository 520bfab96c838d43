"""Suffix decoding: the most frequent continuation of the longest matching suffix, its length
capped by the match's and by the path's probability; the shared trie of ended requests, bounded,
its counts taken out again when one leaves."""

from __future__ import annotations

from engine.spec.suffix import SuffixProposer, SuffixTrie, follow


def test_the_most_frequent_continuation_is_followed():
    t = SuffixTrie(8)
    t.add([1, 2, 3, 1, 2, 3, 1, 2, 4])
    node, m = t.match([9, 1, 2], 7)
    assert m == 2
    out, _ = follow(node, 3, 0.1)
    assert out == [3, 1, 2]  # 3 followed [1, 2] twice, 4 once


def test_min_probability_stops_the_path():
    t = SuffixTrie(8)
    t.add([1, 2, 3, 1, 2, 4, 1, 2, 5])
    node, _ = t.match([1, 2], 7)
    assert follow(node, 3, 0.5)[0] == []  # each continuation has 1/3
    assert len(follow(node, 3, 0.3)[0]) >= 1


def test_proposal_length_is_capped_by_the_match():
    p = SuffixProposer(max_depth=16, cache_requests=4, min_token_prob=0.1)
    s = p.new_state()
    text = [10, 11, 12, 13, 14, 15, 16, 17]
    assert p.propose(s, [*text, 10], 8) == [11]  # a one-token match proposes one token
    assert p.propose(p.new_state(), [*text, 10, 11, 12], 8) == [13, 14, 15]
    assert p.propose(p.new_state(), [*text, 10, 11, 12], 2) == [13, 14]


def test_ended_requests_serve_later_ones_and_leave_when_the_cache_is_full():
    p = SuffixProposer(max_depth=8, cache_requests=2, min_token_prob=0.1)
    answer = [50, 51, 52, 53, 54, 55]
    p.finished(None, [1, 2, *answer], num_prompt_tokens=2)
    assert p.propose(p.new_state(), [7, 7, 50, 51, 52], 3) == [53, 54, 55]
    nodes = p.shared.num_nodes
    p.finished(None, [3, 60, 61], num_prompt_tokens=1)
    p.finished(None, [4, 70, 71], num_prompt_tokens=1)  # the first leaves
    assert p.propose(p.new_state(), [7, 7, 50, 51, 52], 3) == []
    assert p.shared.num_nodes < nodes
    p.finished(None, [5, 80], num_prompt_tokens=1)
    p.finished(None, [5, 80], num_prompt_tokens=1)
    assert p.shared.num_nodes == 3  # [5], [5, 80], [80]: both earlier ones left, counts gone


def test_the_sequence_trie_grows_incrementally():
    p = SuffixProposer(max_depth=6, cache_requests=1, min_token_prob=0.0)
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3]
    state = p.new_state()
    for end in range(2, len(seq) + 1):
        assert p.propose(state, seq[:end], 4) == p.propose(p.new_state(), seq[:end], 4), end
