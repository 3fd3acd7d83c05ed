"""`qerr`: the low-cost path's rounding error, per unit, where it quantizes.

For each operand the low path quantizes (GEMM input, weight, output gradient, saved
activation): ||Q(x) - x||^2 and ||x||^2 summed over the step, so each operand's relative
error ||Q(x) - x|| / ||x|| is that of the whole step (all micro-batches, all TP shards; a
replicated operand, the input of a column-parallel linear, is counted once per TP rank in
both sums, which leaves the ratio unchanged). The value is the worst operand's. A unit on the
recovery path keeps reporting the error it would have (shadow measurement), so it can show it
is safe to return.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_gnmr.precision.measurements.base import (
    Measurement,
    Slots,
    low_quantized,
    relative_errors,
)

OPERANDS = ("input", "weight", "grad", "saved_input")


class QuantizationError(Measurement):
    name = "qerr"
    slots = 2 * len(OPERANDS)  # (err^2, ref^2) per operand
    damage_rank = 1  # the operands' error, not the gradient's: second to the oracle

    @torch.no_grad()
    def forward(self, slots: Slots, low_path, x, weight, run_path, x_q, w_q, saved,
                group) -> None:
        for kind, original, computed in (("input", x, x_q), ("weight", weight, w_q),
                                         ("saved_input", x, saved)):
            quantized = low_quantized(low_path, kind, original, run_path, computed, group)
            if quantized is not None:
                slots.add_relative_error(OPERANDS.index(kind), quantized, original)

    @torch.no_grad()
    def output_gradient(self, slots: Slots, low_path, grad_output, run_path, g_q,
                        group) -> None:
        quantized = low_quantized(low_path, "grad", grad_output, run_path, g_q, group)
        if quantized is not None:
            slots.add_relative_error(OPERANDS.index("grad"), quantized, grad_output)

    def value(self, sums: np.ndarray) -> np.ndarray:
        operands = relative_errors(sums.reshape(sums.shape[0], len(OPERANDS), 2))
        measured = ~np.isnan(operands)
        return np.where(measured.any(axis=1),
                        np.max(np.where(measured, operands, -np.inf), axis=1), np.nan)
