"""Trend model: alarm when a signal stops following the trend of its own recent past.

Healthy monitor signals trend (the attention H(D2) keeps rising as training proceeds, router
entropy rises as the router learns), and the faults we look for show up as a change of that
trend: H(D2) stalls, routing entropy drops. So the expected value of each sample is
extrapolated from the signal's own trajectory a little while ago, and the alarm asks whether
the signal has left that extrapolation.

Rule, per signal, at every check after the first `skip + window + horizon` samples:
  1. fit window: the `window` samples that end `horizon` samples before the current one;
  2. robust line through them, against log(step) (`axis`; training curves -- loss,
     saturating router statistics -- are far closer to straight in log step, so a healthy
     run's slowing down is not a change of trend): Theil-Sen slope (median of pairwise slopes) and the median
     intercept, so one spike in the window does not bend the fit;
  3. noise: 1.4826 x the median absolute residual of the fit window (a Gaussian std),
     floored at `min_relative_spread` x |prediction|;
  4. the sample is outside when |value - prediction| > band x noise x inflation, where
     inflation = sqrt(1 + 1/n + (x0 - mean x)^2 / Sxx) is the standard error of a
     straight-line extrapolation from the fit's steps x to the checked step x0 (the lever
     arm of a line fit: ~1.5 with the defaults);
  5. alarm after `patience` consecutive outside samples (`Streak`).
The `horizon` gap is what makes a slow change visible: a stall of slope `ds` has moved the
signal by about ds x (horizon + window / 2) from the extrapolation before the fit window
starts to absorb it. A non-finite value is outside and never enters the history.

Defaults: window 16, horizon 12, band 4, patience 5 (skip 2), log axis: the first check
comes at the 31st sample. The log axis was chosen on the router scenario's healthy runs
(linear axis: the loss and the router-weight similarity alarmed in all three as they
flattened; log axis: two alarms in all), before the attention-fault runs were looked at. Consecutive extrapolations share most of their fit window, so their errors
are correlated and patience buys less than for independent samples: on Gaussian noise
(200 series x 500 samples) patience 3 gave 3.4e-4 false alarms per checked sample, patience
5 gives 1.1e-5 (`tests/test_detectors.py` holds it under `NOISE_FALSE_ALARM_RATE`), for two
more samples of delay on a stall (median 10 samples after a full stall of a slope equal to
the noise std, max 15).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from megatron_gnmr.monitors.config import DEFAULTS  # the settings' one home
from megatron_gnmr.monitors.detectors.streak import FiresByStreak, Streak, beyond

NOISE_FALSE_ALARM_RATE = 1e-4
MAD_TO_STD = 1.4826


def theil_sen(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(slope, intercept) of the Theil-Sen line through the points (x[i], y[i])."""
    i, j = np.triu_indices(len(x), k=1)
    slope = float(np.median((y[j] - y[i]) / (x[j] - x[i])))
    intercept = float(np.median(y - slope * x))
    return slope, intercept


def extrapolation_inflation(x: np.ndarray, x0: float) -> float:
    """Standard error of a straight-line fit on x, extrapolated to x0, in noise units
    (the one-sample noise included)."""
    sxx = float(((x - x.mean()) ** 2).sum())
    return math.sqrt(1.0 + 1.0 / len(x) + (x0 - x.mean()) ** 2 / sxx)


@dataclass
class TrendModel(FiresByStreak):
    kind: ClassVar[str] = "trend"
    skip: int = 2
    window: int = DEFAULTS.monitor_trend_window
    horizon: int = DEFAULTS.monitor_trend_horizon
    band: float = DEFAULTS.monitor_band
    patience: int = DEFAULTS.monitor_patience
    min_relative_spread: float = 1e-3
    direction: int = 0
    """+1 / -1: only a deviation above / below the expectation counts; 0: both."""
    axis: str = "log"
    """The fit's time axis: `log` (log of the step) or `linear` (the step)."""
    seen: int = 0
    history: deque = field(default=None)
    rule: Streak = field(default=None)

    def __post_init__(self):
        self.history = deque(self.history or (), maxlen=self.window + self.horizon)
        if self.rule is None:
            self.rule = Streak(self.patience)

    def expected(self, step: int) -> tuple[float, float] | None:
        """(prediction at `step`, its allowed deviation), once the history suffices.
        The history holds (step, value): a skipped non-finite sample leaves a gap in x."""
        if len(self.history) < self.window + self.horizon:
            return None
        fit = np.array(list(self.history)[: self.window], dtype=np.float64)
        x, y = self._time(fit[:, 0]), fit[:, 1]
        x0 = float(self._time(np.array([step], dtype=np.float64))[0])
        slope, intercept = theil_sen(x, y)
        prediction = intercept + slope * x0
        noise = MAD_TO_STD * float(np.median(np.abs(y - (intercept + slope * x))))
        noise = max(noise, self.min_relative_spread * abs(prediction))
        return prediction, self.band * noise * extrapolation_inflation(x, x0)

    def _time(self, steps: np.ndarray) -> np.ndarray:
        return np.log(np.maximum(steps, 1.0)) if self.axis == "log" else steps

    def update(self, step: int, value: float) -> dict | None:
        finite = math.isfinite(value)
        if finite and self.seen < self.skip:
            self.seen += 1
            return None
        expected = self.expected(step)
        if finite:
            self.history.append((step, value))
        if expected is None:
            return {"expected": None, "band": None} \
                if not finite and self.rule.push(True) else None
        prediction, allowed = expected
        outside = not finite or beyond(value, prediction, allowed, self.direction)
        if self.rule.push(outside):
            return {"expected": prediction, "band": allowed}
        return None

    def state_dict(self) -> dict:
        return {"seen": self.seen, "history": list(self.history),
                "rule": self.rule.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.seen = state["seen"]
        self.history = deque(map(tuple, state["history"]), maxlen=self.window + self.horizon)
        self.rule.load_state_dict(state["rule"])

    @classmethod
    def check(cls, monitor) -> None:
        """Needs nothing beyond its own settings (their ranges: monitors/config.py)."""

    @classmethod
    def for_signal(cls, key: str, book, **shared) -> "TrendModel":
        return cls(window=book.trend_window, horizon=book.trend_horizon, axis=book.trend_axis,
                   **shared)
