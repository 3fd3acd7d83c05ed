"""The online baseline of SPEC 7.3: a band learnt on the signal's own first samples.

The baseline is the mean and standard deviation of a signal's first `baseline_samples`
samples (after `skip` start-up samples); the band is mean +- `band` x std, the std floored at
`min_relative_spread` x |mean| so a nearly constant signal does not alarm on rounding noise.

False-alarm rate on stationary Gaussian noise (measured, 200 series x 500 samples): 0 with the
16 baseline samples, band 4 and patience 3 (the default is now 5); 1.8e-4 per sample with only 8 baseline
samples. Its blind spot, measured on the fault scenarios (docs/results.md): a healthy signal
that trends leaves a band learnt on its early values, and a faulty one that merely stops
trending does not, so it misses slow faults and false-alarms on healthy drift. The trend
model and the reference band exist for that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from megatron_gnmr.monitors.config import DEFAULTS  # the settings' one home
from megatron_gnmr.monitors.detectors.streak import FiresByStreak, Streak, beyond


@dataclass
class OnlineBand(FiresByStreak):
    kind: ClassVar[str] = "online"
    skip: int = 2
    baseline_samples: int = DEFAULTS.monitor_baseline_samples
    band: float = DEFAULTS.monitor_band
    patience: int = DEFAULTS.monitor_patience
    min_relative_spread: float = 0.01
    direction: int = 0
    """+1 / -1: only a deviation above / below the baseline counts; 0: both."""
    seen: int = 0
    total: float = 0.0
    total_sq: float = 0.0
    rule: Streak = field(default=None)

    def __post_init__(self):
        if self.rule is None:
            self.rule = Streak(self.patience)

    @property
    def ready(self) -> bool:
        return self.seen >= self.skip + self.baseline_samples

    @property
    def mean(self) -> float:
        return self.total / self.baseline_samples

    @property
    def spread(self) -> float:
        variance = max(self.total_sq / self.baseline_samples - self.mean**2, 0.0)
        return max(math.sqrt(variance), self.min_relative_spread * abs(self.mean))

    def update(self, step: int, value: float) -> dict | None:
        """Add one sample; the alarm's details when this sample raises one."""
        if math.isfinite(value) and not self.ready:
            self.seen += 1
            if self.seen > self.skip:
                self.total += value
                self.total_sq += value * value
            return None
        if not self.ready:  # a non-finite value before the band exists is still outside
            return {"expected": None, "band": None} if self.rule.push(True) else None
        outside = not math.isfinite(value) or \
            beyond(value, self.mean, self.band * self.spread, self.direction)
        if self.rule.push(outside):
            return {"expected": self.mean, "band": self.band * self.spread}
        return None

    def state_dict(self) -> dict:
        """Counters only: the band, patience and baseline length are settings."""
        return {"seen": self.seen, "total": self.total, "total_sq": self.total_sq,
                "rule": self.rule.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.seen, self.total, self.total_sq = state["seen"], state["total"], state["total_sq"]
        self.rule.load_state_dict(state["rule"])

    @classmethod
    def check(cls, monitor) -> None:
        if monitor.monitor_reference:
            raise ValueError("--monitor-reference uses the reference detector; drop "
                             "--monitor-detector online or the references")

    @classmethod
    def for_signal(cls, key: str, book, **shared) -> "OnlineBand":
        return cls(baseline_samples=book.baseline_samples, **shared)
