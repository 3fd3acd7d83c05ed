"""Reference band: alarm when a signal leaves the band of healthy reference runs.

`--monitor-reference RUN_DIR [RUN_DIR ...]` names runs of the same model, data and schedule
that stayed healthy; their logged monitor signals (`metrics.jsonl`) give, at every check
step, the expected value and spread of each signal. This is the detector that knows the
expected trend exactly, at the price of needing healthy runs first.

Rule, per signal and check step s:
  - live and reference series are smoothed the same way: the trailing mean of their last
    `smooth` samples;
  - expected = mean over the references at s; spread = the largest of: the std across
    references at s (ddof 1), its median over all steps (with two or three references the
    std at one step can be small by chance; seed-to-seed offsets persist), the references'
    own sample-to-sample noise (1.4826 x MAD of first differences / sqrt(2 x smooth)), and
    `min_relative_spread` x |expected|;
  - outside when live - expected is beyond band x spread on the watched side (`direction`;
    a non-finite value is outside);
  - alarm after `patience` consecutive outside checks. Steps no reference logged are not
    checked, nor the first `skip` samples (start-up transients differ by seed).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from megatron_gnmr.monitors.config import DEFAULTS  # the settings' one home
from megatron_gnmr.monitors.detectors.streak import FiresByStreak, Streak, beyond
from megatron_gnmr.monitors.detectors.trend import MAD_TO_STD


def trailing_mean(values: np.ndarray, smooth: int) -> np.ndarray:
    """Mean of each sample and up to `smooth - 1` samples before it."""
    sums = np.cumsum(np.concatenate([[0.0], values]))
    index = np.arange(1, len(values) + 1)
    start = np.maximum(index - smooth, 0)
    return (sums[index] - sums[start]) / (index - start)


def sample_noise(values: np.ndarray) -> float:
    """Robust std of one sample around the local trend, from first differences."""
    if len(values) < 3:
        return 0.0
    diffs = np.diff(values)
    return MAD_TO_STD * float(np.median(np.abs(diffs - np.median(diffs)))) / math.sqrt(2.0)


@dataclass
class ReferenceProfile:
    """Expected value and spread of one signal per step, from its reference series."""

    mean: dict[int, float]
    spread: dict[int, float]

    @classmethod
    def from_series(cls, series: list[dict[int, float]], smooth: int,
                    min_relative_spread: float) -> "ReferenceProfile":
        smoothed, noises = [], []
        for one in series:
            steps = sorted(s for s, v in one.items() if math.isfinite(v))
            values = np.array([one[s] for s in steps], dtype=np.float64)
            smoothed.append(dict(zip(steps, trailing_mean(values, smooth))))
            noises.append(sample_noise(values) / math.sqrt(smooth))
        noise = float(np.median(noises)) if noises else 0.0
        mean, across = {}, {}
        for step in sorted(set().union(*smoothed)):
            at_step = np.array([s[step] for s in smoothed if step in s])
            mean[step] = float(at_step.mean())
            across[step] = float(at_step.std(ddof=1)) if len(at_step) > 1 else 0.0
        typical = float(np.median(list(across.values()))) if across else 0.0
        spread = {step: max(across[step], typical, noise, min_relative_spread * abs(mean[step]))
                  for step in mean}
        return cls(mean, spread)


@dataclass
class ReferenceBand(FiresByStreak):
    kind: ClassVar[str] = "reference"
    profile: ReferenceProfile
    skip: int = 2
    smooth: int = DEFAULTS.monitor_reference_smooth
    band: float = DEFAULTS.monitor_band
    patience: int = DEFAULTS.monitor_patience
    direction: int = 0
    """+1 / -1: only a deviation above / below the references counts; 0: both."""
    seen: int = 0
    recent: deque = field(default=None)
    rule: Streak = field(default=None)

    def __post_init__(self):
        self.recent = deque(self.recent or (), maxlen=self.smooth)
        if self.rule is None:
            self.rule = Streak(self.patience)

    def update(self, step: int, value: float) -> dict | None:
        finite = math.isfinite(value)
        if finite:
            self.seen += 1
            self.recent.append(value)
        if finite and self.seen <= self.skip:
            return None
        if step not in self.profile.mean:
            return None
        expected, spread = self.profile.mean[step], self.profile.spread[step]
        live = float(np.mean(self.recent)) if self.recent else math.nan
        outside = not finite or beyond(live, expected, self.band * spread, self.direction)
        if self.rule.push(outside):
            return {"expected": expected, "band": self.band * spread}
        return None

    def state_dict(self) -> dict:
        return {"seen": self.seen, "recent": list(self.recent), "rule": self.rule.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]
        self.recent = deque(state["recent"], maxlen=self.smooth)
        self.rule.load_state_dict(state["rule"])

    @classmethod
    def check(cls, monitor) -> None:
        if not monitor.monitor_reference:
            raise ValueError("--monitor-detector reference needs --monitor-reference RUN_DIR ...")

    @classmethod
    def for_signal(cls, key: str, book, **shared) -> "ReferenceBand":
        return cls(book.reference_profile(key), smooth=book.reference_smooth, **shared)
