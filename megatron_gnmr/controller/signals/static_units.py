"""`static` (a baseline): the units matching `--gnmr-static-units` (default every fc2) are
always risky, the others never: the fixed selection that production rules make."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from megatron_gnmr.controller.signals.base import Observations, RiskSignal


@dataclass
class StaticSettings:
    static_units: str = r"mlp\.(experts\.\d+\.)?linear_fc2$"
    """static baseline: regex of the units it recovers."""

    def check(self) -> None:
        try:
            re.compile(self.static_units)
        except re.error as error:
            raise ValueError(f"gnmr.static_units {self.static_units!r}: not a valid regex "
                             f"({error})") from None


class StaticSignal(RiskSignal):
    name = "static"
    settings_class = StaticSettings

    def __init__(self, unit_names: list[str], settings: dict):
        super().__init__(unit_names, settings)
        pattern = re.compile(settings["static_units"])
        self.chosen = np.array([bool(pattern.search(name)) for name in unit_names])

    def scores(self, observations: Observations) -> np.ndarray:
        return np.where(self.chosen, 2.0, 0.0)
