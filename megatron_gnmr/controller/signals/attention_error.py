"""`attention_error`: the closed loop's early detector. A core attention is risky while the
low path's biased delta makes up more than `--gnmr-attention-error-threshold` of its score
gradient (`attention_error`, precision/measurements/attention_delta_error.py: ||P * (delta_low
- delta_exact)|| / ||P * (dP - delta_exact)||, the whole step's), as the median of its last
`--gnmr-attention-error-window` steps (one step's value is noisy), and for
`--gnmr-attention-error-hold` decisions after.

It needs no foreign run and no history: the value is a ratio of the run's own gradient
parts, read from the first step, so it can act in the first hundreds of steps where a trend
detector is still filling its window. A recovered attention keeps being measured in the
shadow, so it returns to the low path once its low path would be harmless again (after the
hold). The threshold, window and start the scenario uses were chosen on the no-budget twins
of its first seven seeds (docs/results.md section 11 says how, and what it costs on
exact-attention runs); the defaults (1.0, one step) are neutral.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from megatron_gnmr.controller.signals.base import Hold, Observations, RiskSignal, legacy_hold
from megatron_gnmr.limits import limit


@dataclass
class AttentionErrorSettings:
    attention_error_threshold: float = limit(1.0, gt=0)
    """attention_error: a core attention is risky when its low path's delta error exceeds this
    share of its score gradient."""
    attention_error_hold: int = limit(0, ge=-1)
    """attention_error: decisions a unit stays risky after its error falls back (-1: the rest
    of the run)."""
    attention_error_window: int = limit(1, ge=1)
    """attention_error: the median over this many steps is compared (1: each step's own)."""


class AttentionErrorSignal(RiskSignal):
    name = "attention_error"
    observes = ("attention_error",)
    settings_class = AttentionErrorSettings

    def __init__(self, unit_names: list[str], settings: dict):
        super().__init__(unit_names, settings)
        self.threshold = float(settings["attention_error_threshold"])
        self.hold = Hold(len(unit_names), int(settings["attention_error_hold"]))
        self.recent = np.full((int(settings["attention_error_window"]), len(unit_names)),
                              np.nan)  # the last values, oldest first
        self.seen = 0

    def scores(self, observations: Observations) -> np.ndarray:
        self.recent = np.roll(self.recent, -1, axis=0)
        self.recent[-1] = observations.measured[self.observes[0]]
        self.seen += 1
        with np.errstate(invalid="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a unit never measured: NaN
            median = np.nanmedian(self.recent[-min(self.seen, len(self.recent)):], axis=0)
        score = median / self.threshold  # NaN: a linear, or nothing measured
        return self.hold(score, held_score=np.fmax(score, 1.0 + 1e-9))

    def state_dict(self) -> dict:
        return {"hold": self.hold.state_dict(), "recent": self.recent.copy(), "seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.hold.load_state_dict(state["hold"] if "hold" in state else legacy_hold(state))
        self.recent = np.array(state["recent"], dtype=np.float64)
        self.seen = int(state["seen"])


class KernelDeltaErrorSignal(AttentionErrorSignal):
    """`kernel_delta_error`: the same rule on the kernel probe's relative delta error (the
    backward's delta against dO . O recomputed in float64 on sampled rows), with the same
    knobs; nothing of the fault is read."""

    name = "kernel_delta_error"
    observes = ("kernel_delta_error",)
