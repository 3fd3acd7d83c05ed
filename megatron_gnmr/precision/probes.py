"""Probes: the damage of the low-cost path, measured where the quantization happens.

Per unit and step, on the device, summed over micro-batches (read once per step by the
controller, in the same all-reduce as the gradient norms):

- `qerr`: for each operand the low-cost path quantizes (GEMM input, weight, output gradient,
  saved activation): ||Q(x) - x||^2 and ||x||^2, so the relative error ||Q(x) - x|| / ||x||
  of the whole step (all micro-batches, all TP shards) is sqrt(sum err^2 / sum ref^2).
  While a unit runs the recovery path, its operands are quantized with the LOW path's specs
  and compared without the result being used ("shadow" measurement): a recovered unit keeps
  reporting the error it would have, so it can show it is safe to return.
- `oracle` (experiments only): ||dW_low - dW_exact||^2 and ||dW_exact||^2, with dW_exact the
  weight gradient of an exact side GEMM on the unquantized operands and dW_low the low-cost
  path's weight gradient (a second side GEMM while the unit runs the recovery path). Costs
  one or two extra GEMMs per unit and keeps the exact input alive until backward.

Sums of squares add over TP shards and micro-batches; a replicated operand (the input of a
column-parallel linear) is counted once per TP rank in both sums, which leaves the ratio
unchanged.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_gnmr.precision.paths import saved_for_weight_gradient, weight_gradient
from megatron_gnmr.precision.scaling import quantize

OPERANDS = ("input", "weight", "grad", "saved_input")
ORACLE = len(OPERANDS)  # slot pair index of the weight-gradient error
SLOTS = 2 * (len(OPERANDS) + 1)  # (err^2, ref^2) per operand, then for the oracle


def relative_errors(sums: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(qerr, oracle) per unit from the all-reduced [units, SLOTS] sums of squares: qerr is
    the worst operand's relative error; NaN where nothing was measured."""
    pairs = sums.reshape(sums.shape[0], SLOTS // 2, 2)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratios = np.sqrt(pairs[:, :, 0] / pairs[:, :, 1])  # 0/0 -> NaN: not measured
    operands = ratios[:, :ORACLE]
    measured = ~np.isnan(operands)
    qerr = np.where(measured.any(axis=1),
                    np.nanmax(np.where(measured, operands, -np.inf), axis=1), np.nan)
    return qerr, ratios[:, ORACLE]


class ProbeBank:
    """[num_units, SLOTS] float64 sums for the current step, indexed by global unit."""

    def __init__(self, unit_names: list[str], low_path, oracle: bool, device=None):
        self.index = {name: i for i, name in enumerate(unit_names)}
        self.low_path = low_path
        self.oracle = oracle
        self.sums = torch.zeros(len(unit_names), SLOTS, dtype=torch.float64, device=device)

    def probe(self, unit_name: str) -> "UnitProbe | None":
        index = self.index.get(unit_name)
        return None if index is None else UnitProbe(self, index)

    def take(self) -> torch.Tensor:
        """This step's sums (flattened), and a fresh start for the next step."""
        sums = self.sums.reshape(-1).clone()
        self.sums.zero_()
        return sums


class UnitProbe:
    def __init__(self, bank: ProbeBank, index: int):
        self.bank = bank
        self.index = index

    @property
    def oracle(self) -> bool:
        return self.bank.oracle

    def _add(self, pair: int, value: torch.Tensor, reference: torch.Tensor) -> None:
        """Adds ||value - reference||^2 and ||reference||^2, each in one fused pass with no
        temporary (in float32): the probes' cost is memory traffic, and the GEMMs they ride
        along make only a few passes more over the same operands."""
        row = self.bank.sums[self.index]
        reference = reference.float()
        row[2 * pair] += torch.dist(value.float(), reference).double().square()
        row[2 * pair + 1] += torch.linalg.vector_norm(reference).double().square()

    def _low_quantized(self, kind: str, original, run_path, computed, group):
        """The low path's quantization of `original`: reused when the running path made it."""
        spec = getattr(self.bank.low_path, kind)
        if spec is None:
            return None
        if getattr(run_path, kind) == spec:
            return computed
        return quantize(original, spec, amax_group=group)

    @torch.no_grad()
    def forward_operands(self, x, weight, run_path, x_q, w_q, saved, group) -> None:
        for kind, original, computed in (("input", x, x_q), ("weight", weight, w_q),
                                         ("saved_input", x, saved)):
            quantized = self._low_quantized(kind, original, run_path, computed, group)
            if quantized is not None:
                self._add(OPERANDS.index(kind), quantized, original)

    @torch.no_grad()
    def grad_operand(self, grad_output, run_path, g_q, group) -> None:
        quantized = self._low_quantized("grad", grad_output, run_path, g_q, group)
        if quantized is not None:
            self._add(OPERANDS.index("grad"), quantized, grad_output)

    @torch.no_grad()
    def weight_gradient(self, grad_output, x_exact, run_path, grad_weight, group) -> None:
        """Oracle: the low path's weight gradient against the exact one."""
        g = grad_output.reshape(-1, grad_output.shape[-1])
        x = x_exact.reshape(-1, x_exact.shape[-1])
        exact = torch.matmul(g.t(), x)
        low = self.bank.low_path
        if run_path == low:
            low_grad = grad_weight
        else:
            g_low = g if low.grad is None else quantize(g, low.grad, amax_group=group)
            x_low = x if low.input is None else quantize(x, low.input, amax_group=group)
            saved = saved_for_weight_gradient(x, x_low, low, group)
            low_grad = weight_gradient(g, g_low, saved, low, group)
        self._add(ORACLE, low_grad, exact)


def build_probes(config, registry) -> ProbeBank | None:
    """The run's probe bank, when its controller's signals measure the low path."""
    from megatron_gnmr.precision.backends import build_recipe

    if registry is None or not config.gnmr.probed():
        return None
    from megatron_gnmr.platform.device import run_device

    recipe = build_recipe(config.precision)
    return ProbeBank(registry.names, recipe.low, oracle="oracle" in config.gnmr.probed(),
                     device=run_device())
