"""Draftless speculative decoding: a proposer guesses the next tokens of a decoding sequence from
text it has seen (its own prompt and output, recent requests' outputs), the step runs the last
token and the guesses as one chunk of rows, and verification keeps the longest run of guesses the
model agrees with, plus one token of its own (docs/speculative.md).

- proposer.py: the seam (``Proposer``); ngram.py and suffix.py implement it.
- adaptive.py: how many tokens each sequence may propose, following its acceptance.
- decoder.py: ``make_proposer``, and ``SpecDecoder``, what the engine step calls: proposals
  before scheduling (checked against a grammar), statistics, the end of a request.
- verify.py: the sampling rows of a step with drafts, and the accept rule, which leaves the
  target distribution (and a seeded request's tokens) exactly as decoding without drafts.
"""
