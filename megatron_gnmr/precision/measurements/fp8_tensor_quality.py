"""`fp8_underflow` and `fp8_mse`: the quantization quality metrics of Transformer Engine's
AutoswitchGemm (NVIDIA/TransformerEngine pull request 2883, open; read at its commit
0721ed25: `transformer_engine/debug/features/autoswitch_gemm.py`), on the core attention's
FP8 operands (Q, K, V and P in E4M3, dO in E5M2).

Per operand, as the pull request computes them on a tensor x and its dequantized FP8 copy q:
  underflow % = 100 x #(x != 0 and q == 0) / #x,   MSE = mean((x - q)^2)  (x's own units);
and a GEMM's metric is the worst of the operands it reads (OR over tensors). The core
attention is one unit here, switched as a whole, so its value is the worst over all five
operands. Where ours differs: the counts and squared errors are summed over the step's
micro-batches and every TP rank's heads before the ratio (one decision for all ranks, from
the whole tensors; the pull request decides per rank, per micro-batch call). A recovered
attention is measured in the shadow (its operands quantized aside as the low path would).

`fp8_underflow_o` and `fp8_mse_o` give the rule the right to see O as well, the tensor a fault
of the delta stage lives in (issue 56's fair arm): O against O as the low path's backward
holds it (E4M3 on the healthy path, the fault's rounding where it acts).
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_gnmr.precision.measurements.base import Measurement, Slots

OPERANDS = ("q", "k", "v", "p", "do")


class FP8Underflow(Measurement):
    name = "fp8_underflow"
    operands = OPERANDS
    slots = 3 * len(OPERANDS)  # per operand: underflowed elements, squared error, elements
    watches = "attention"

    @torch.no_grad()
    def attention_operands(self, slots: Slots, low_path, run_path, operands: dict,
                           group) -> None:
        if not low_path.fp8:
            return  # the low path holds these operands exactly
        for name in operands:
            if name not in self.operands:
                continue
            underflowed, squared_error, elements = _operand_quality(operands, name, run_path,
                                                                    group)
            where = 3 * self.operands.index(name)
            slots.add(where, underflowed)
            slots.add(where + 1, squared_error)
            slots.add_count(where + 2, elements)  # a number: no copy to the device

    def per_operand(self, sums: np.ndarray) -> np.ndarray:
        """[units, operands, (underflowed, squared error, elements)]."""
        return sums.reshape(sums.shape[0], len(self.operands), 3)

    def worst(self, part: np.ndarray, elements: np.ndarray) -> np.ndarray:
        """The worst operand's part / elements per unit (NaN: nothing measured)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            ratios = np.where(elements > 0, part / elements, np.nan)
        measured = ~np.isnan(ratios)
        return np.where(measured.any(axis=1),
                        np.max(np.where(measured, ratios, -np.inf), axis=1), np.nan)

    def value(self, sums: np.ndarray) -> np.ndarray:
        per = self.per_operand(sums)
        return 100.0 * self.worst(per[..., 0], per[..., 2])


def _operand_quality(operands: dict, name: str, run_path, group):
    """(underflowed elements, squared error, elements) of one operand against its FP8 hold;
    computed once per call for every metric of this module (`probes.SharedOperands.memo`)."""
    from megatron_gnmr.precision.flash_attention import fp8_spec_of
    from megatron_gnmr.precision.scaling import quantize

    memo = getattr(operands, "memo", {})
    if ("fp8_quality", name) not in memo:
        exact, held = operands[name]
        # O comes with the low path's hold of it, made in the shadow by the kernel
        low = held if run_path.fp8 or name == "o" else quantize(exact, fp8_spec_of(name), group)
        exact, low = exact.float(), low.float()
        memo["fp8_quality", name] = (torch.count_nonzero((exact != 0) & (low == 0)),
                                     torch.dist(low, exact).square(), exact.numel())
    return memo["fp8_quality", name]


class FP8MeanSquaredError(FP8Underflow):
    name = "fp8_mse"

    def value(self, sums: np.ndarray) -> np.ndarray:
        per = self.per_operand(sums)
        return self.worst(per[..., 1], per[..., 2])


class FP8UnderflowWithOutput(FP8Underflow):
    name = "fp8_underflow_o"
    operands = (*OPERANDS, "o")
    slots = 3 * len(operands)
    reads_output = True


class FP8MeanSquaredErrorWithOutput(FP8UnderflowWithOutput):
    name = "fp8_mse_o"
    value = FP8MeanSquaredError.value
