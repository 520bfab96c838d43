"""How many tokens one sequence may propose next, following how many of its proposals the model
accepted: text that keeps repeating earns the full ``num_speculative_tokens``, text that does not
falls to none, so its steps cost what they cost without speculation.

After a verification of ``proposed`` tokens of which ``accepted`` were kept: all kept raises the
limit by one; some kept sets it to ``accepted + 1``; none kept halves it, and at one a miss pauses
the sequence's proposals for a number of steps that doubles with each further miss (1, 2, 4, ...
up to ``MAX_PAUSE``), so a sequence probes again now and then. A kept proposal ends the pause
doubling. ``adaptive=False`` keeps the limit at the maximum."""

from __future__ import annotations

MAX_PAUSE = 64


class DraftBudget:
    __slots__ = ("adaptive", "limit", "maximum", "pause", "paused")

    def __init__(self, maximum: int, adaptive: bool = True) -> None:
        self.maximum = self.limit = maximum
        self.adaptive = adaptive
        self.pause = 0  # the pause after the next miss at limit 1
        self.paused = 0  # steps left without proposals

    def allowed(self) -> int:
        """Tokens the sequence may propose this step (0 while paused; a paused step counts)."""
        if self.paused > 0:
            self.paused -= 1
            return 0
        return self.limit

    def observe(self, proposed: int, accepted: int) -> None:
        if not self.adaptive or proposed == 0:
            return
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
