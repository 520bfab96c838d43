"""``SpecDecoder``: what the engine step calls for speculative decoding.

Before the scheduler runs, ``propose`` gives each decoding sequence its drafts for this step
(``Request.spec_token_ids``): at most its ``DraftBudget`` allows, no more than its remaining
``max_tokens`` can use, cut after the first EOS or stop token, and cut where its grammar (a
structured output) would refuse one. The scheduler runs them with the sequence's last token as
one chunk of rows (engine/core/scheduler.py); verify.py keeps what the model agrees with; the
step then commits the kept drafts' KV (``LLMEngine._commit_drafts``) and tells ``observe``.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.config import SpeculativeConfig
from engine.core.request import Request
from engine.spec.adaptive import BUSY_BATCH, DraftBudget
from engine.spec.ngram import NgramProposer
from engine.spec.proposer import Proposer
from engine.spec.stats import SpecStats
from engine.spec.suffix import SuffixProposer


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        return SuffixProposer(
            config.suffix_max_depth, config.suffix_cache_requests, config.suffix_min_token_prob
        )
    raise ValueError(f"speculative method: no proposer for {config.method!r}")


class SeqSpec:
    """One sequence's proposer state and draft budget (kept on its Request as ``spec``)."""

    __slots__ = ("budget", "state")

    def __init__(self, state, budget: DraftBudget) -> None:
        self.state, self.budget = state, budget


class SpecDecoder:
    def __init__(
        self,
        config: SpeculativeConfig,
        eos_token_ids: Iterable[int],
        proposer: Proposer | None = None,
    ) -> None:
        self.config = config
        self.proposer = proposer or make_proposer(config)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stats = SpecStats()
        self.stats.accepted_per_position = [0] * config.num_speculative_tokens

    def _seq(self, req: Request) -> SeqSpec:
        if req.spec is None:
            budget = DraftBudget(self.config.num_speculative_tokens, self.config.adaptive)
            req.spec = SeqSpec(self.proposer.new_state(), budget)
        return req.spec

    def propose(self, running: Iterable[Request]) -> None:
        """Set each running request's drafts for the coming step ([] for most)."""
        running = list(running)
        decoding = [r.num_computed_tokens == r.num_tokens - 1 and r.num_output_tokens > 0
                    for r in running]  # fmt: skip
        busy = sum(decoding) > BUSY_BATCH
        for req, decodes in zip(running, decoding, strict=True):
            req.spec_token_ids = []
            if not decodes:
                continue  # not decoding: its prompt (or a recompute) is still running
            room = req.params.max_tokens - req.num_output_tokens - 1  # the model adds one
            if room <= 0:
                continue
            seq = self._seq(req)
            k = min(seq.budget.allowed(busy), room)
            if k <= 0:
                continue
            drafts = self.proposer.propose(seq.state, req.all_token_ids, k)
            if drafts:
                req.spec_token_ids = self._usable(req, drafts)

    def _usable(self, req: Request, drafts: list[int]) -> list[int]:
        """``drafts`` cut after the first token that would end the sequence, and before the
        first one its grammar refuses."""
        p = req.params
        stops = set() if p.ignore_eos else set(self.eos_token_ids)
        stops |= set(p.stop_token_ids)
        for i, t in enumerate(drafts):
            if t in stops:  # kept as the last draft, unless min_tokens masks it there
                drafts = drafts[: i if req.num_output_tokens + i < p.min_tokens else i + 1]
                break
        if req.grammar is not None:
            drafts = drafts[: req.grammar.valid_prefix(drafts)]
        return drafts

    def observe(self, req: Request, proposed: int, accepted: int) -> None:
        """A verification of ``req``: ``accepted`` of its ``proposed`` drafts were kept."""
        if req.spec is not None:
            req.spec.budget.observe(proposed, accepted)
        with self.stats.lock:
            self.stats.verifications += 1
            self.stats.proposed += proposed
            self.stats.accepted += accepted
            for i in range(accepted):
                self.stats.accepted_per_position[i] += 1

    def finished(self, req: Request) -> None:
        """``req`` ended normally: its text may serve later requests (suffix)."""
        state = req.spec.state if req.spec is not None else None
        self.proposer.finished(state, req.all_token_ids, req.num_prompt_tokens)
