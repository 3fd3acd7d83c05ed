"""`attention_bias`: whether the low path's delta error has a sign, per core attention and step
(the nature of the fault, where `attention_error` measures its size).

The low path's backward computes delta = rowsum(dO * O) from O as it holds it, so each row i
of the step errs by e_i = delta_low_i - delta_exact_i. An unbiased rounding of O (E4M3 with
round-to-nearest, `--attention-fp8-output`) gives errors of either sign; a biased one (the
fault's rounding toward -inf) pushes them one way wherever dO and O are alike across rows,
and it is this agreement that accumulates into the W_q/W_k updates (Qiu & Yao). The value is
  sum_i e_i / sum_i |e_i|
over the step's rows (all micro-batches, every TP rank's heads): +-1 when every row errs the
same way, near 0 for an unbiased rounding, NaN when the low path's delta is exact (no error to
sign). Scale-free, so one threshold serves every layer and step; a sequential test on it
(`controller/signals/attention_bias.py`) answers "is there a bias" in a few steps.

Measured on the dO the run holds, for the low path when the unit runs it and in the shadow when
it runs exact, like `attention_error`. Cost: one rowsum and three reductions over the rows.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_gnmr.precision.measurements.base import Measurement, Slots


class AttentionDeltaBias(Measurement):
    name = "attention_bias"
    slots = 2  # sum_i e_i, sum_i |e_i|
    watches = "attention"

    @torch.no_grad()
    def attention_delta(self, slots: Slots, low_path, run_path, probabilities, grad_p,
                        grad_out, out, group) -> None:
        from megatron_gnmr.precision.flash_attention import held_output

        grad_out, out = grad_out.float(), out.float()
        held = held_output(out, low_path, group, probabilities)
        error = (grad_out * (held - out)).sum(dim=-1)
        slots.add(0, error.sum())
        slots.add(1, error.abs().sum())

    def value(self, sums: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(sums[:, 1] > 0, sums[:, 0] / sums[:, 1], np.nan)


class OutputRoundingBias(Measurement):
    """`rounding_bias`: the sign agreement of the rounding of O itself, sum(O_held - O) /
    sum|O_held - O| over the elements the low path's backward holds: -1 or +1 for a rounding
    that always errs one way (the fault's rounding toward -inf), near 0 for round-to-nearest
    (E4M3), NaN where O is held exactly. An audit of the rounding, blind to what it does to
    the gradient; `attention_bias` weighs it by dO."""

    name = "rounding_bias"
    slots = 2  # sum(O_held - O), sum|O_held - O|
    watches = "attention"

    @torch.no_grad()
    def attention_delta(self, slots: Slots, low_path, run_path, probabilities, grad_p,
                        grad_out, out, group) -> None:
        from megatron_gnmr.precision.flash_attention import held_output

        out = out.float()
        error = held_output(out, low_path, group, probabilities) - out
        slots.add(0, error.sum())
        slots.add(1, error.abs().sum())

    value = AttentionDeltaBias.value
