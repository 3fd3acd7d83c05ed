"""`attention_bias`: a sequential test of whether a core attention's delta error has a sign
(the fault's nature: a biased rounding), where `attention_error` waits for its size.

Per unit and step it reads b_t = sum_i e_i / sum_i |e_i|, the sign agreement of the low path's
delta error over the step's rows (`precision/measurements/attention_delta_bias.py`: near 0 for
an unbiased rounding, up to +-1 for a biased one), and runs Page's two-sided CUSUM on it:
  S+_t = max(0, S+_{t-1} + b_t - k),   S-_t = max(0, S-_{t-1} - b_t - k),
risky once max(S+_t, S-_t) > h (`--gnmr-attention-bias-drift` k, `--gnmr-attention-bias-
threshold` h; score max(S+, S-) / h). k is the largest |b| an unbiased rounding is allowed to
show step after step (its drift is absorbed), h how much evidence beyond it makes an alarm:
a bias of b > k alarms after about h / (b - k) steps, so a strong bias is named within a few
steps and a weak one later, where a median of the error's size over a window waits for the
window and for the size to cross a level the healthy run never reaches. Two-sided because
nothing here knows which way a fault rounds. A step with no value (NaN: nothing measured,
or an exact delta) leaves the sums as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_gnmr.controller.signals.base import Hold, Observations, RiskSignal
from megatron_gnmr.limits import limit


@dataclass
class AttentionBiasSettings:
    attention_bias_drift: float = limit(0.1, ge=0, lt=1)
    """attention_bias: the sign agreement of the delta error an unbiased rounding may show in
    every step (the CUSUM's reference value k)."""
    attention_bias_threshold: float = limit(1.0, gt=0)
    """attention_bias: the CUSUM's decision level h (evidence beyond the drift, summed over
    steps)."""
    attention_bias_hold: int = limit(-1, ge=-1)
    """attention_bias: decisions a unit stays risky after its CUSUM falls back (-1: the rest of
    the run: the bias is the low path's, a unit sent back meets it again)."""


class AttentionBiasSignal(RiskSignal):
    name = "attention_bias"
    observes = ("attention_bias",)
    settings_class = AttentionBiasSettings

    def __init__(self, unit_names: list[str], settings: dict):
        super().__init__(unit_names, settings)
        self.drift = float(settings["attention_bias_drift"])
        self.threshold = float(settings["attention_bias_threshold"])
        self.upper = np.zeros(len(unit_names))  # S+
        self.lower = np.zeros(len(unit_names))  # S-
        self.hold = Hold(len(unit_names), int(settings["attention_bias_hold"]))

    def scores(self, observations: Observations) -> np.ndarray:
        bias = observations.measured[self.observes[0]]
        seen = np.isfinite(bias)
        self.upper[seen] = np.maximum(0.0, self.upper[seen] + bias[seen] - self.drift)
        self.lower[seen] = np.maximum(0.0, self.lower[seen] - bias[seen] - self.drift)
        return self.hold(np.maximum(self.upper, self.lower) / self.threshold)

    def state_dict(self) -> dict:
        return {"upper": self.upper.copy(), "lower": self.lower.copy(),
                "hold": self.hold.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.upper = np.array(state["upper"], dtype=np.float64)
        self.lower = np.array(state["lower"], dtype=np.float64)
        self.hold.load_state_dict(state["hold"])


class RoundingBiasSignal(AttentionBiasSignal):
    """`rounding_bias`: the same test on the sign agreement of O's own rounding
    (`precision/measurements/attention_delta_bias.py`), with the same knobs."""

    name = "rounding_bias"
    observes = ("rounding_bias",)


class KernelOutputBiasSignal(AttentionBiasSignal):
    """`kernel_output_bias`: the same test on what the kernel probe sees, the sign agreement
    of O's error against a float64 recomputation of sampled rows from the kernel's own Q, K
    and V (`precision/measurements/kernel_probe.py`): nothing of the fault is read."""

    name = "kernel_output_bias"
    observes = ("kernel_output_bias",)


class KernelDeltaBiasSignal(AttentionBiasSignal):
    """`kernel_delta_bias`: the same test on the kernel probe's delta error (the backward's
    delta against dO . O recomputed in float64 on sampled rows)."""

    name = "kernel_delta_bias"
    observes = ("kernel_delta_bias",)
