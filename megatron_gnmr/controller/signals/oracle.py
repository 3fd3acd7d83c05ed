"""`oracle` (experiments only): 1 + the true relative error of the unit's low-path weight
gradient at this step (an exact side GEMM, `precision/measurements/weight_gradient_error.py`):
the best choice any signal could make at the same budget, the yardstick of "damage caught"."""

from __future__ import annotations

import numpy as np

from megatron_gnmr.controller.signals.base import Observations, RiskSignal


class OracleSignal(RiskSignal):
    name = "oracle"
    observes = ("oracle",)

    def scores(self, observations: Observations) -> np.ndarray:
        return 1.0 + np.nan_to_num(observations.measured["oracle"], nan=0.0)
