"""`qerr`: the low-cost path's own damage, measured where it quantizes.

e_u = max over the unit's low-path operands of ||Q(x) - x|| / ||x||
(`precision/measurements/quantization_error.py`), scored against `qerr_ratio` x a baseline:
the unit's own running mean of e (`history`, like GNMR) or this step's median over units
(`peers`: damage that is structural, some units always worse than the others, shows against
the peers and never against the unit's own past).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_gnmr.controller.signals.base import Observations, RiskSignal
from megatron_gnmr.limits import limit

BASELINES = ("history", "peers")


@dataclass
class QerrSettings:
    qerr_ratio: float = limit(1.5, gt=0)
    """qerr: a unit is risky when its quantization error exceeds this x its baseline."""
    qerr_baseline: str = limit("history", choices=BASELINES)
    """qerr baseline: history (the unit's own running mean, like GNMR) or peers (this step's
    median over units)."""


class QerrSignal(RiskSignal):
    name = "qerr"
    observes = ("qerr",)
    settings_class = QerrSettings

    def __init__(self, unit_names: list[str], settings: dict):
        super().__init__(unit_names, settings)
        self.ratio = settings["qerr_ratio"]
        self.baseline = settings["qerr_baseline"]
        self.qerr_sum = np.zeros(len(unit_names))
        self.qerr_count = np.zeros(len(unit_names), dtype=np.int64)

    def scores(self, observations: Observations) -> np.ndarray:
        qerr = observations.measured["qerr"]
        finite = np.isfinite(qerr)
        with np.errstate(invalid="ignore", divide="ignore"):
            if self.baseline == "peers":
                baseline = np.full(qerr.shape, np.nanmedian(qerr) if finite.any() else np.nan)
            else:
                baseline = np.where(self.qerr_count > 0,
                                    self.qerr_sum / np.maximum(self.qerr_count, 1), np.nan)
            score = qerr / (self.ratio * baseline)
        self.qerr_sum[finite] += qerr[finite]
        self.qerr_count[finite] += 1
        return score

    def state_dict(self) -> dict:
        return {"qerr_sum": self.qerr_sum.copy(), "qerr_count": self.qerr_count.copy()}

    def load_state_dict(self, state: dict) -> None:
        self.qerr_sum = np.array(state["qerr_sum"], dtype=np.float64)
        self.qerr_count = np.array(state["qerr_count"], dtype=np.int64)
