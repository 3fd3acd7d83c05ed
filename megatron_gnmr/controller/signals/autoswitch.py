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
hold window"; its description of an earlier revision had one). `--gnmr-autoswitch-scope
global` is the pull request's default `hold_window_scope`: a breach anywhere makes every unit
risky (give `--gnmr-max-o` the number of units to let them all switch); `unit` (our default)
switches the breaching unit alone.

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

from megatron_gnmr.controller.signals.base import Hold, Observations, RiskSignal, legacy_hold
from megatron_gnmr.limits import limit

SCOPES = ("unit", "global")


@dataclass
class AutoswitchSettings:
    autoswitch_underflow_pct: float = limit(5.0, gt=0)
    """autoswitch: risky when an FP8 operand's underflow share exceeds this (percent)."""
    autoswitch_mse: float = limit(1e-4, gt=0)
    """autoswitch: ... or its quantization MSE exceeds this (the tensor's own units)."""
    autoswitch_hold: int = limit(0, ge=0)
    """autoswitch: decisions a unit stays risky after a breach (0: only the next step)."""
    autoswitch_scope: str = limit("unit", choices=SCOPES)
    """autoswitch: what a breach switches: its own unit, or every unit (global: the pull
    request's default hold_window_scope, one breach sends every GEMM of the rank high)."""


class AutoswitchSignal(RiskSignal):
    name = "autoswitch"
    observes = ("fp8_underflow", "fp8_mse")
    settings_class = AutoswitchSettings

    def __init__(self, unit_names: list[str], settings: dict):
        super().__init__(unit_names, settings)
        self.underflow_pct = float(settings["autoswitch_underflow_pct"])
        self.mse = float(settings["autoswitch_mse"])
        self.hold = Hold(len(unit_names), int(settings["autoswitch_hold"]))
        self.everywhere = settings.get("autoswitch_scope", "unit") == "global"

    def scores(self, observations: Observations) -> np.ndarray:
        underflow, mse = (observations.measured[name] for name in self.observes)
        with np.errstate(invalid="ignore"):
            score = np.fmax(underflow / self.underflow_pct, mse / self.mse)  # NaN: not measured
        if self.everywhere and np.isfinite(score).any():
            score = np.full_like(score, np.nanmax(score))  # the worst unit's, for every unit
        return self.hold(score)

    def state_dict(self) -> dict:
        return {"hold": self.hold.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.hold.load_state_dict(state["hold"] if "hold" in state else legacy_hold(state))


class AutoswitchWithOutputSignal(AutoswitchSignal):
    """`autoswitch_o`: the same rule with the right to see O too (`fp8_underflow_o`,
    `fp8_mse_o`: O against the low path's hold of it, the tensor a delta-stage fault lives in),
    the rival given what our probe is given."""

    name = "autoswitch_o"
    observes = ("fp8_underflow_o", "fp8_mse_o")
