"""`static` (a baseline): the units matching `--gnmr-static-units` (default every fc2) are
always risky, the others never: the fixed selection that production rules make."""

from __future__ import annotations

import re

import numpy as np

from megatron_gnmr.controller.signals.base import Observations, RiskSignal


class StaticSignal(RiskSignal):
    name = "static"

    def __init__(self, unit_names: list[str], settings: dict):
        super().__init__(unit_names, settings)
        pattern = re.compile(settings["static_units"])
        self.chosen = np.array([bool(pattern.search(name)) for name in unit_names])

    def scores(self, observations: Observations) -> np.ndarray:
        return np.where(self.chosen, 2.0, 0.0)
