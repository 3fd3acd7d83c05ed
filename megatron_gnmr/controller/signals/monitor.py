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

from megatron_gnmr.controller.signals.base import Observations, RiskSignal
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
        self.hold = int(settings["monitor_hold"])
        self.remaining: dict[str, int] = {}
        """Prefix -> decisions it stays named after its alarm cleared (-1: always)."""

    def scores(self, observations: Observations) -> np.ndarray:
        for prefix in observations.alarmed:
            self.remaining[prefix] = self.hold
        for prefix, left in list(self.remaining.items()):
            if prefix in observations.alarmed:
                continue
            if left == 0:
                del self.remaining[prefix]
            elif left > 0:
                self.remaining[prefix] = left - 1
        prefixes = tuple(self.remaining)
        return np.array([SCORE if prefixes and name.startswith(prefixes) else 0.0
                         for name in self.unit_names])

    def state_dict(self) -> dict:
        return {"remaining": dict(self.remaining)}

    def load_state_dict(self, state: dict) -> None:
        self.remaining = dict(state.get("remaining", {}))
