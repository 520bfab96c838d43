"""How many tokens one sequence may propose next, following how many of its proposals the model
accepted: text that keeps repeating earns the full ``num_speculative_tokens``, text that does not
falls to none, so its steps cost what they cost without speculation.

After a verification of ``proposed`` tokens of which ``accepted`` were kept: all kept raises the
limit by one; some kept sets it to ``accepted + 1``; none kept halves it, and at one a miss pauses
the sequence's proposals for a number of steps that doubles with each further miss (1, 2, 4, ...
up to ``MAX_PAUSE``), so a sequence probes again now and then. A kept proposal ends the pause
doubling. ``adaptive=False`` keeps the limit at the maximum.

In a busy step (more than ``BUSY_BATCH`` sequences decoding) a draft row costs about what a decode
row costs (on a 2-core CPU a step of 16 rows is compute-bound: verification is no longer nearly
free), so only sequences whose recent share of kept drafts (``rate``, an exponential average) is
at least ``BUSY_MIN_RATE`` propose there."""

from __future__ import annotations

MAX_PAUSE = 64
BUSY_BATCH = 8
BUSY_MIN_RATE = 0.6
RATE_WEIGHT = 0.3  # of the latest verification in ``rate``


class DraftBudget:
    __slots__ = ("adaptive", "limit", "maximum", "pause", "paused", "rate")

    def __init__(self, maximum: int, adaptive: bool = True) -> None:
        self.maximum = self.limit = maximum
        self.adaptive = adaptive
        self.pause = 0  # the pause after the next miss at limit 1
        self.paused = 0  # steps left without proposals
        self.rate = 1.0  # recent share of proposed drafts kept (optimistic at first)

    def allowed(self, busy: bool = False) -> int:
        """Tokens the sequence may propose this step (0 while paused; a paused step counts;
        0 in a busy step unless its drafts are mostly kept)."""
        if self.paused > 0:
            self.paused -= 1
            return 0
        if busy and self.adaptive and self.rate < BUSY_MIN_RATE:
            return 0
        return self.limit

    def observe(self, proposed: int, accepted: int) -> None:
        if not self.adaptive or proposed == 0:
            return
        self.rate += RATE_WEIGHT * (accepted / proposed - self.rate)
        if accepted == proposed:
            self.limit = min(self.maximum, self.limit + 1)
            self.pause = 0
        elif accepted > 0:
            self.limit = min(self.maximum, accepted + 1)
            self.pause = 0
        elif self.limit > 1:
            self.limit = max(1, self.limit // 2)
        else:
            self.pause = min(MAX_PAUSE, max(1, self.pause * 2))
            self.paused = self.pause
