"""When a run has diverged: its training loss, averaged over the last 20 steps, 20% above the
running minimum of that average (after the first 100 steps). One rule for the result tables
(offline, over the logged losses: `experiments/tables.py`) and for `--stop-on-divergence`
(online, so a sweep does not spend CPU hours training a run that has already failed)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

WINDOW = 20
FACTOR = 1.2
WARMUP = 100


@dataclass
class DivergenceRule:
    window: list[float] = field(default_factory=list)
    """The last WINDOW losses (checkpointed with the run state)."""
    best: float = math.inf
    """The lowest WINDOW-step mean so far."""

    def observe(self, step: int, loss: float) -> bool:
        """Take step `step`'s loss; True when the run has diverged at this step."""
        self.window = [*self.window, loss][-WINDOW:]
        if len(self.window) < WINDOW:
            return False
        smoothed = statistics.mean(self.window) if all(map(math.isfinite, self.window)) \
            else math.inf
        if step > WARMUP and smoothed > FACTOR * self.best:
            return True
        self.best = min(self.best, smoothed)
        return False
