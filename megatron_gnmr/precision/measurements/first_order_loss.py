"""`loss_cost` (experiments): the first-order change of the loss that the low path's forward
quantization of a unit causes, per step.

With y = x W^T the unit's output and dy = Q(x) Q(W)^T - x W^T the error the low path puts
into it (Q: the low path's fprop quantization; a unit on the recovery path is measured in the
shadow), the loss moves by <dL/dy, dy> to first order: summed over the step's tokens, it is
the loss the unit's forward rounding costs now, the quantity relative errors (qerr, the
oracle) stand in for without knowing where an error costs loss. It is a plain sum, so it adds
over micro-batches and TP ranks (a column-parallel rank holds a slice of y and of dL/dy, a
row-parallel rank a partial sum of y against the whole dL/dy). Signed: a rounding that
happens to lower the loss counts against one that raises it; the noise cancels over steps,
the bias stays. The weight gradient's damage is not in it (the oracle's).

`loss_cost_gross` sums the same terms' magnitudes, sum |dL/dy * dy| over the output's
elements: how much loss the rounding moves in either direction. It is the yardstick of the
signed sum: loss_cost / loss_cost_gross near 0 is rounding noise that cancels, near +-1 a
rounding that pushes the loss one way (a bias); and two layouts or kernels whose float32
partial sums flip a few roundings differ in loss_cost by a small share of loss_cost_gross,
however small loss_cost itself happens to be (tests/distributed/test_precision_tp.py).

Cost: one extra output-sized GEMM per probed call (two in the shadow), and the output error
kept until the call's backward; each of the two names pays its own.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_gnmr.precision.measurements.base import Measurement, Slots, low_quantized


class FirstOrderLossCost(Measurement):
    name = "loss_cost"
    slots = 2  # sum of <dL/dy, dy>, and the calls measured (0: not measured)
    damage_rank = -1  # the loss itself, before any relative error

    @torch.no_grad()
    def forward(self, slots: Slots, low_path, x, weight, run_path, x_q, w_q, saved,
                group) -> None:
        x_low = low_quantized(low_path, "input", x, run_path, x_q, group)
        w_low = low_quantized(low_path, "weight", weight, run_path, w_q, group)
        if x_low is None and w_low is None:
            return  # the low path's forward is exact: it costs the loss nothing here
        x_low = x if x_low is None else x_low
        w_low = weight if w_low is None else w_low
        slots.carry["output_error"] = torch.matmul(x_low, w_low.t()) - torch.matmul(
            x, weight.t())

    @torch.no_grad()
    def output_gradient(self, slots: Slots, low_path, grad_output, run_path, g_q,
                        group) -> None:
        error = slots.carry.pop("output_error", None)
        if error is not None:
            slots.add(0, torch.sum(grad_output.float() * error.float()))
            slots.add(1, torch.ones((), dtype=torch.float64))

    def value(self, sums: np.ndarray) -> np.ndarray:
        return np.where(sums[:, 1] > 0, sums[:, 0], np.nan)


class GrossFirstOrderLossCost(FirstOrderLossCost):
    name = "loss_cost_gross"
    damage_rank = None  # a scale for loss_cost, not a ranking of damage

    @torch.no_grad()
    def output_gradient(self, slots: Slots, low_path, grad_output, run_path, g_q,
                        group) -> None:
        error = slots.carry.pop("output_error", None)
        if error is not None:
            slots.add(0, torch.sum(torch.abs(grad_output.float() * error.float())))
            slots.add(1, torch.ones((), dtype=torch.float64))
