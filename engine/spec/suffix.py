"""Suffix decoding (Oliaro et al., "SuffixDecoding", 2024; vLLM's "suffix"): every suffix of a
text, cut at ``max_depth`` tokens, is counted in a trie, so a node's children say how often each
token followed that path. To propose, the longest suffix of the sequence found in a trie is the
match; from its node the most frequent child is followed while the product of the children's
shares stays at or above ``min_token_prob``, for at most as many tokens as the match is long (a
one-token match proposes one token) and ``k``.

Two tries are searched and the proposal with the larger expected number of accepted tokens (the
sum of the path's probabilities) wins: one per sequence over its own prompt and output (grown as
it decodes), and one shared by all over the prompts' tails and outputs of the last
``cache_requests`` requests that ended normally (the oldest leaves first, its counts taken out
again), which is what pays on agent loops and repeated tool calls.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from engine.spec.proposer import Proposer

PROMPT_TAIL = 1024  # tokens of an ended request's prompt put in the shared trie, with its output


class Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, Node] = {}


class SuffixTrie:
    """Counts of every path of at most ``max_depth`` tokens in the texts added."""

    def __init__(self, max_depth: int) -> None:
        self.root = Node()
        self.max_depth = max_depth
        self.num_nodes = 0

    def add(self, tokens: Sequence[int], sign: int = 1) -> None:
        """Count (sign 1) or uncount (-1) every suffix path of ``tokens``."""
        depth = self.max_depth
        for i in range(len(tokens)):
            node = self.root
            for t in tokens[i : i + depth]:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = Node()
                    self.num_nodes += 1
                child.count += sign
                if child.count <= 0:
                    self._drop(node, t)
                    break
                node = child

    def _drop(self, parent: Node, token: int) -> None:
        gone = [parent.children.pop(token)]
        while gone:
            node = gone.pop()
            self.num_nodes -= 1
            gone.extend(node.children.values())

    def match(self, tokens: Sequence[int], max_len: int) -> tuple[Node | None, int]:
        """The node of the longest suffix of ``tokens`` (at most ``max_len``) that is a path."""
        for m in range(min(max_len, len(tokens)), 0, -1):
            node = self.root
            for t in tokens[len(tokens) - m :]:
                node = node.children.get(t)
                if node is None:
                    break
            else:
                if node.children:
                    return node, m
        return None, 0


def follow(node: Node, k: int, min_prob: float) -> tuple[list[int], float]:
    """The most frequent path below ``node`` while its probability stays >= ``min_prob``, and
    the path's expected number of accepted tokens."""
    out, prob, score = [], 1.0, 0.0
    while len(out) < k and node.children:
        total = sum(c.count for c in node.children.values())
        token, child = max(node.children.items(), key=lambda kv: kv[1].count)
        prob *= child.count / total
        if prob < min_prob:
            break
        out.append(token)
        score += prob
        node = child
    return out, score


class SuffixState:
    """One sequence's own trie, grown as tokens are appended: ``open`` holds the nodes of the
    paths that end at its last token (each grows by the next token until ``max_depth``)."""

    __slots__ = ("indexed", "open", "trie")

    def __init__(self, max_depth: int) -> None:
        self.trie = SuffixTrie(max_depth)
        self.open: list[tuple[Node, int]] = []
        self.indexed = 0

    def extend(self, tokens: Sequence[int]) -> None:
        trie = self.trie
        for t in tokens[self.indexed :]:
            grown = []
            for node, depth in [*self.open, (trie.root, 0)]:
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = Node()
                    trie.num_nodes += 1
                child.count += 1
                if depth + 1 < trie.max_depth:
                    grown.append((child, depth + 1))
            self.open = grown
        self.indexed = len(tokens)


class SuffixProposer(Proposer):
    def __init__(self, max_depth: int, cache_requests: int, min_token_prob: float) -> None:
        self.max_depth = max_depth
        self.min_prob = min_token_prob
        self.shared = SuffixTrie(max_depth)
        self.cached: deque[list[int]] = deque()
        self.cache_requests = cache_requests

    def new_state(self) -> SuffixState:
        return SuffixState(self.max_depth)

    def propose(self, state: SuffixState, tokens: Sequence[int], k: int) -> list[int]:
        if k <= 0 or len(tokens) < 2:
            return []
        # The sequence's trie holds every token but the last: a match must be an earlier
        # occurrence, with a continuation (the last token is added on the next call).
        state.extend(tokens[:-1])
        best: list[int] = []
        best_score = 0.0
        limit = self.max_depth - 1
        for trie in (state.trie, self.shared):
            node, m = trie.match(tokens, limit)
            if node is None:
                continue
            out, score = follow(node, min(k, m), self.min_prob)
            if score > best_score:
                best, best_score = out, score
        return best

    def finished(self, state: SuffixState, tokens: Sequence[int], num_prompt_tokens: int) -> None:
        text = list(tokens[max(0, num_prompt_tokens - PROMPT_TAIL) :])
        self.shared.add(text)
        self.cached.append(text)
        while len(self.cached) > self.cache_requests:
            self.shared.add(self.cached.popleft(), sign=-1)
