"""`monitor`: while a mechanism monitor's alarm is firing, the units it names are risky (an
attention alarm of layer l: that layer's attention units; a router alarm: its MLP/expert
units; `monitors/families.py` says which)."""

from __future__ import annotations

import numpy as np

from megatron_gnmr.controller.signals.base import Observations, RiskSignal

SCORE = 2.0


class MonitorSignal(RiskSignal):
    name = "monitor"
    observes = ("alarmed",)

    def scores(self, observations: Observations) -> np.ndarray:
        prefixes = tuple(observations.alarmed)
        return np.array([SCORE if prefixes and name.startswith(prefixes) else 0.0
                         for name in self.unit_names])
