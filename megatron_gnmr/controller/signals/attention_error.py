"""`attention_error`: the closed loop's early detector. A core attention is risky while the
low path's biased delta makes up more than `--gnmr-attention-error-threshold` of its score
gradient (`attention_error`, precision/measurements/attention_delta_error.py: ||P * (delta_low
- delta_exact)|| / ||P * (dP - delta_exact)||, the whole step's), and for
`--gnmr-attention-error-hold` decisions after.

It needs no foreign run and no history: the value is a ratio of the run's own gradient
parts, read from the first step, so it can act in the first hundreds of steps where a trend
detector is still filling its window. A recovered attention keeps being measured in the
shadow, so it returns to the low path once its low path would be harmless again (after the
hold). The threshold was chosen on the twin runs of the scenario's first seeds
(docs/results.md section 11 says how, and what it costs on exact-attention runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_gnmr.controller.signals.base import Observations, RiskSignal
from megatron_gnmr.limits import limit


@dataclass
class AttentionErrorSettings:
    attention_error_threshold: float = limit(1.0, gt=0)
    """attention_error: a core attention is risky when its low path's delta error exceeds this
    share of its score gradient."""
    attention_error_hold: int = limit(0, ge=-1)
    """attention_error: decisions a unit stays risky after its error falls back (-1: the rest
    of the run)."""


class AttentionErrorSignal(RiskSignal):
    name = "attention_error"
    observes = ("attention_error",)
    settings_class = AttentionErrorSettings

    def __init__(self, unit_names: list[str], settings: dict):
        super().__init__(unit_names, settings)
        self.threshold = float(settings["attention_error_threshold"])
        self.hold = int(settings["attention_error_hold"])
        self.held = np.zeros(len(unit_names), dtype=np.int64)  # -1: for good

    def scores(self, observations: Observations) -> np.ndarray:
        score = observations.measured["attention_error"] / self.threshold
        breached = score > 1.0  # NaN (a linear, or nothing measured) compares False
        holding = ~breached & (self.held != 0)
        out = np.where(holding, np.fmax(score, 1.0 + 1e-9), score)
        self.held[holding & (self.held > 0)] -= 1
        self.held[breached] = self.hold
        return out

    def state_dict(self) -> dict:
        return {"held": self.held.copy()}

    def load_state_dict(self, state: dict) -> None:
        self.held = np.array(state["held"], dtype=np.int64)
