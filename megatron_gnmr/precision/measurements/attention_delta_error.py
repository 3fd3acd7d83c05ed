"""`attention_error`: how much of the attention's score gradient the low path's delta gets
wrong, per core attention and step (the early detector of the closed loop reads it).

Flash attention's backward computes dS = P * (dP - delta) with delta = rowsum(dO * O). The
low path holds O with a biased rounding inside delta (`--attention-fault-bits`, Qiu & Yao),
or in E4M3 (`--attention-fp8-output`, unbiased), so its dS is off by P * (delta_exact -
delta_low) in every row. The measured value is
  ||P * (delta_low - delta_exact)|| / ||P * (dP - delta_exact)||
over the step's rows (all micro-batches, every TP rank's heads): the share of the score
gradient that is the rounding's. It is measured on the dO and P the run holds, for the low
path when the unit runs it and in the shadow when it runs exact (the same formula, delta_low
computed aside), so a recovered attention keeps reporting what its low path would do.

Why this and not the operands' own error: the low path's FP8 operands have the same relative
error in healthy and dying runs; what changes as a run heads for divergence is how large the
biased part of the gradient is next to the true one (dP - delta shrinks as the attention
sharpens, the bias does not).

Cost: two rowsums and two elementwise passes over P per call; nothing kept past the call.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_gnmr.precision.measurements.base import Measurement, Slots, relative_errors


class AttentionDeltaError(Measurement):
    name = "attention_error"
    slots = 2  # ||P * (delta_low - delta_exact)||^2, ||P * (dP - delta_exact)||^2
    watches = "attention"

    @torch.no_grad()
    def attention_delta(self, slots: Slots, low_path, run_path, probabilities, grad_p,
                        grad_out, out, group) -> None:
        from megatron_gnmr.precision.flash_attention import held_output

        grad_out, out, p = grad_out.float(), out.float(), probabilities.float()
        delta_exact = (grad_out * out).sum(dim=-1, keepdim=True)
        held = held_output(out, low_path, group, probabilities)
        delta_low = (grad_out * held).sum(dim=-1, keepdim=True)
        # sum_ij P_ij^2 (delta_low - delta_exact)_i^2, without a [rows, keys] temporary
        slots.add(0, torch.sum((delta_low - delta_exact).square()
                               * p.square().sum(dim=-1, keepdim=True)))
        slots.add(1, torch.sum((p * (grad_p.float() - delta_exact)).square()))

    def value(self, sums: np.ndarray) -> np.ndarray:
        return relative_errors(sums[:, None, :])[:, 0]
