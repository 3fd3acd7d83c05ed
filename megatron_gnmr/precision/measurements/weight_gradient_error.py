"""`oracle` (experiments): the true relative error of the low path's weight gradient.

||dW_low - dW_exact||^2 and ||dW_exact||^2 summed over the step, with dW_exact the weight
gradient of an exact side GEMM on the unquantized operands and dW_low the low path's (a second
side GEMM while the unit runs the recovery path). Costs one or two GEMMs per unit and keeps
the exact input alive until backward: the yardstick of "damage caught", not a production
signal.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_gnmr.precision.measurements.base import Measurement, Slots, relative_errors
from megatron_gnmr.precision.paths import saved_for_weight_gradient, weight_gradient
from megatron_gnmr.precision.scaling import quantize


class WeightGradientError(Measurement):
    name = "oracle"
    slots = 2
    keeps_exact_input = True
    damage_rank = 0  # the error the optimizer actually receives

    @torch.no_grad()
    def weight_gradient(self, slots: Slots, low_path, grad_output, x_exact, run_path,
                        grad_weight, group) -> None:
        g = grad_output.reshape(-1, grad_output.shape[-1])
        x = x_exact.reshape(-1, x_exact.shape[-1])
        exact = torch.matmul(g.t(), x)
        if run_path == low_path:
            low_grad = grad_weight
        else:
            g_low = g if low_path.grad is None else quantize(g, low_path.grad,
                                                              amax_group=group)
            x_low = x if low_path.input is None else quantize(x, low_path.input,
                                                              amax_group=group)
            saved = saved_for_weight_gradient(x, x_low, low_path, group)
            low_grad = weight_gradient(g, g_low, saved, low_path, group)
        slots.add_relative_error(0, low_grad, exact)

    def value(self, sums: np.ndarray) -> np.ndarray:
        return relative_errors(sums)
