"""Probes: the run's measured quantities, taken where the quantization happens.

Per unit and step, on the device, summed over micro-batches and read once per step by the
controller, in the same all-reduce as the gradient norms. What is measured is the registry's
business (`precision/measurements/`: `qerr`, the low path's rounding error; `oracle`, its
weight gradient's true error); the bank holds one row of float64 sums per unit, each
measurement owning a contiguous run of slots, and a unit's probe hands each GEMM event to
every measurement of the run that watches that kind of unit (a unit linear's GEMMs, or a core
attention's operands and backward: `precision/flash_attention.py` calls the latter).
"""

from __future__ import annotations

import torch

from megatron_gnmr.precision.measurements import Slots, layout


class ProbeBank:
    """[num_units, slots of the run's measurements] float64 sums for the current step,
    indexed by global unit."""

    def __init__(self, unit_names: list[str], low_path, measured: tuple[str, ...],
                 device=None):
        self.index = {name: i for i, name in enumerate(unit_names)}
        self.low_path = low_path
        self.layout = layout(measured)
        self.keeps_exact_input = any(m.keeps_exact_input for m, _ in self.layout)
        width = sum(measurement.slots for measurement, _ in self.layout)
        self.sums = torch.zeros(len(unit_names), width, dtype=torch.float64, device=device)

    def watches(self, kind: str) -> bool:
        """Whether some measurement of the run watches `kind` units (linear, attention)."""
        return any(measurement.watches == kind for measurement, _ in self.layout)

    def probe(self, unit_name: str) -> "UnitProbe | None":
        index = self.index.get(unit_name)
        return None if index is None else UnitProbe(self, index)

    def take(self) -> torch.Tensor:
        """This step's sums (flattened), and a fresh start for the next step."""
        sums = self.sums.reshape(-1).clone()
        self.sums.zero_()
        return sums


class UnitProbe:
    """What a unit linear's kernel calls at each GEMM event of one call (a new probe per
    forward call, kept in the call's autograd context for its backward; nothing it computes
    is read by the step: the kernels pass their tensors and carry on)."""

    def __init__(self, bank: ProbeBank, index: int):
        self.bank = bank
        row = bank.sums[index]
        self.slots = [(measurement, Slots(row[where])) for measurement, where in bank.layout
                      if measurement.watches == "linear"]
        self.attention_slots = [(measurement, Slots(row[where]))
                                for measurement, where in bank.layout
                                if measurement.watches == "attention"]
        self.watches_output = any(m.reads_output for m, _ in self.attention_slots)

    @property
    def keeps_exact_input(self) -> bool:
        """The kernel must keep the unquantized input for `weight_gradient`."""
        return self.bank.keeps_exact_input

    @torch.no_grad()
    def forward_operands(self, x, weight, run_path, x_q, w_q, saved, group) -> None:
        for measurement, slots in self.slots:
            measurement.forward(slots, self.bank.low_path, x, weight, run_path, x_q, w_q,
                                saved, group)

    @torch.no_grad()
    def grad_operand(self, grad_output, run_path, g_q, group) -> None:
        for measurement, slots in self.slots:
            measurement.output_gradient(slots, self.bank.low_path, grad_output, run_path, g_q,
                                        group)

    @torch.no_grad()
    def weight_gradient(self, grad_output, x_exact, run_path, grad_weight, group) -> None:
        for measurement, slots in self.slots:
            if measurement.keeps_exact_input:
                measurement.weight_gradient(slots, self.bank.low_path, grad_output, x_exact,
                                            run_path, grad_weight, group)


    @torch.no_grad()
    def attention_operands(self, low_path, run_path, operands: dict, group) -> None:
        """A core attention's FP8 operands (name -> (exact, held)); the paths are
        `flash_attention.AttentionPath`s."""
        shared = SharedOperands(operands)
        for measurement, slots in self.attention_slots:
            measurement.attention_operands(slots, low_path, run_path, shared, group)

    @torch.no_grad()
    def attention_delta(self, low_path, run_path, probabilities, grad_p, grad_out, out,
                        group) -> None:
        for measurement, slots in self.attention_slots:
            measurement.attention_delta(slots, low_path, run_path, probabilities, grad_p,
                                        grad_out, out, group)

    @torch.no_grad()
    def attention_kernel(self, view) -> None:
        """The call as a production kernel exposes it (`kernel_view.KernelView`)."""
        for measurement, slots in self.attention_slots:
            measurement.attention_kernel(slots, view)


class SharedOperands(dict):
    """One call's attention operands with a `memo` its measurements share: what several of
    them compute alike (the four FP8 quality metrics count the same underflows and squared
    errors) is computed once. It lives for the one call, so it holds no tensor longer."""

    def __init__(self, operands: dict):
        super().__init__(operands)
        self.memo: dict = {}


def build_probes(config, registry) -> ProbeBank | None:
    """The run's probe bank, when its controller measures something. The linears' low path
    is the recipe's (None without one: then only the attention is measured)."""
    from megatron_gnmr.precision.backends import build_recipe

    if registry is None or not config.gnmr.probed():
        return None
    from megatron_gnmr.platform.device import run_device

    recipe = build_recipe(config.precision)
    return ProbeBank(registry.names, recipe.low if recipe is not None else None,
                     config.gnmr.probed(), device=run_device())
