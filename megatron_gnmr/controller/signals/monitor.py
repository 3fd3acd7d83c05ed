"""`monitor`: while a mechanism monitor's alarm is firing, the units it names are risky (an
attention alarm of layer l: that layer's core attention where it is a unit, else its
attention linears; a router alarm: its MLP/expert units; `monitors/families.py` says which),
and for `--gnmr-monitor-hold` decisions after it clears (-1, the default: for the rest of
the run).

Why hold by default: the mechanisms the monitors watch are properties of the low-cost path
(a biased rounding, a routing feedback), not transients. Recovery removes the cause, the
update spectrum heals and the alarm clears; a unit sent back then meets the same bias, and
the detector needs tens of checks to see it again (the trend model's window), which the
damage does not wait for. A run that wants the unit back sets a finite hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_gnmr.controller.signals.base import Hold, Observations, RiskSignal
from megatron_gnmr.limits import limit

SCORE = 2.0


@dataclass
class MonitorSignalSettings:
    monitor_hold: int = limit(-1, ge=-1)
    """monitor signal: decisions a unit stays risky after the alarm naming it clears (-1: the
    rest of the run; controller/signals/monitor.py says why that is the default)."""


class MonitorSignal(RiskSignal):
    name = "monitor"
    observes = ("alarmed",)
    settings_class = MonitorSignalSettings

    def __init__(self, unit_names: list[str], settings: dict):
        super().__init__(unit_names, settings)
        self.hold = Hold(len(unit_names), int(settings["monitor_hold"]))

    def _named(self, prefixes) -> np.ndarray:
        """Per unit, whether one of the unit-name prefixes names it."""
        prefixes = tuple(prefixes)
        return np.array([bool(prefixes) and name.startswith(prefixes)
                         for name in self.unit_names])

    def scores(self, observations: Observations) -> np.ndarray:
        return self.hold(np.where(self._named(observations.alarmed), SCORE, 0.0))

    def state_dict(self) -> dict:
        return {"hold": self.hold.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if "hold" in state:
            self.hold.load_state_dict(state["hold"])
            return
        # a checkpoint of before the shared hold: decisions left per alarmed prefix
        for prefix, left in state.get("remaining", {}).items():
            named = self._named((prefix,))
            self.hold.left[named] = left
            self.hold.score[named] = SCORE
