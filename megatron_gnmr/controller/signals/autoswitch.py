"""`autoswitch`: Transformer Engine's AutoswitchGemm rule (NVIDIA/TransformerEngine pull
request 2883, open; read at its commit 0721ed25), the switch a TE user would turn on instead
of ours.

The rule: a GEMM runs in high precision when one of the FP8 tensors it reads breaches a
threshold, the share of its nonzero elements that underflow to zero above
`underflow_threshold_pct` (default 5%) or the MSE of its quantization above `mse_threshold`
(default 1e-4, in the tensor's own units). Here it reads the same two metrics of each core
attention's FP8 operands (`fp8_underflow`, `fp8_mse`: precision/measurements/
fp8_tensor_quality.py) and scores a unit max(underflow / threshold, MSE / threshold), so it is
risky exactly when the pull request would switch it; `--gnmr-autoswitch-hold N` keeps it risky
for N more decisions (0: the pull request's behaviour at that commit, "no cross-iteration
hold window"; its description of an earlier revision had one).

Where ours differs, by construction of the controller: the decision from step s's metrics
acts in step s + 1, not in step s (the pull request consumes a metric in the iteration that
produced it); the metrics are the whole step's, summed over micro-batches and TP ranks, not
one rank's call; the core attention switches as a whole, not per GEMM; and the controller's
lock (`--gnmr-t-lock`) and warm-up apply unless set to their minimum (the scenario does:
`--gnmr-t-lock 0 --gnmr-delta 1 --gnmr-warmup 2`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_gnmr.controller.signals.base import Observations, RiskSignal
from megatron_gnmr.limits import limit


@dataclass
class AutoswitchSettings:
    autoswitch_underflow_pct: float = limit(5.0, gt=0)
    """autoswitch: risky when an FP8 operand's underflow share exceeds this (percent)."""
    autoswitch_mse: float = limit(1e-4, gt=0)
    """autoswitch: ... or its quantization MSE exceeds this (the tensor's own units)."""
    autoswitch_hold: int = limit(0, ge=0)
    """autoswitch: decisions a unit stays risky after a breach (0: only the next step)."""


class AutoswitchSignal(RiskSignal):
    name = "autoswitch"
    observes = ("fp8_underflow", "fp8_mse")
    settings_class = AutoswitchSettings

    def __init__(self, unit_names: list[str], settings: dict):
        super().__init__(unit_names, settings)
        self.underflow_pct = float(settings["autoswitch_underflow_pct"])
        self.mse = float(settings["autoswitch_mse"])
        self.hold = int(settings["autoswitch_hold"])
        self.held = np.zeros(len(unit_names), dtype=np.int64)  # decisions still held
        self.held_score = np.zeros(len(unit_names))

    def scores(self, observations: Observations) -> np.ndarray:
        with np.errstate(invalid="ignore"):
            score = np.fmax(observations.measured["fp8_underflow"] / self.underflow_pct,
                            observations.measured["fp8_mse"] / self.mse)
        breached = score > 1.0  # NaN (not measured) compares False
        holding = ~breached & (self.held > 0)
        out = np.where(holding, self.held_score, score)
        self.held[holding] -= 1
        self.held[breached] = self.hold
        self.held_score[breached] = score[breached]
        return out

    def state_dict(self) -> dict:
        return {"held": self.held.copy(), "held_score": self.held_score.copy()}

    def load_state_dict(self, state: dict) -> None:
        self.held = np.array(state["held"], dtype=np.int64)
        self.held_score = np.array(state["held_score"], dtype=np.float64)
