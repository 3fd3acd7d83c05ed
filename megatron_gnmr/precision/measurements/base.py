"""What a measured quantity is: the contract of `--gnmr-measure` and the probed signals.

A measurement watches a unit's GEMMs where the low-cost path quantizes (the emulated and the
torchao kernels call the hooks below through `precision/probes.py`), adds float64 sums into
its own `slots` of the unit's row, and turns the row, summed over micro-batches and every
rank by the controller's one statistics all-reduce, into one value per unit (`value`). The
trace records the values under the measurement's `name`; replay hands them back to the risk
signals unchanged, so a measurement needs nothing beyond this file to be traced, replayed
and scored offline.

A measurement watches one kind of unit (`watches`): the unit linears' GEMMs (above), or the
core attention (`--attention-precision fp8` / `--attention-fault-bits`: its `attention_*`
hooks, called by `precision/flash_attention.py` with the attention's FP8 operands and its
backward's delta stage).

Sums are what crosses ranks, so a measurement's value must be a function of sums (sums of
squares, counts, dot products); a maximum or a median over ranks is not one. Hooks run inside
`torch.no_grad` and must not change what they are given: nothing of the step reads them.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from megatron_gnmr.precision.scaling import quantize


class Slots:
    """One unit's slots of one measurement in one GEMM call: a view of the probe bank's row,
    and `carry`, what the forward hook keeps for the backward hooks of the same call (it dies
    with the call's autograd context: memory only while the call's activations live)."""

    def __init__(self, row: torch.Tensor):
        self.row = row
        self.carry: dict = {}

    def add(self, slot: int, amount: torch.Tensor) -> None:
        self.row[slot] += amount.double()

    def add_count(self, slot: int, count: int) -> None:
        """A number known on the host (an element count): added as a scalar argument of the
        device op, where a tensor made of it would be one host-to-device copy per call."""
        self.row[slot] += count

    def add_relative_error(self, pair: int, value: torch.Tensor,
                           reference: torch.Tensor) -> None:
        """Slots 2*pair, 2*pair+1 += ||value - reference||^2, ||reference||^2, each in one
        fused pass with no temporary (in float32): a probe's cost is memory traffic."""
        reference = reference.float()
        self.add(2 * pair, torch.dist(value.float(), reference).square())
        self.add(2 * pair + 1, torch.linalg.vector_norm(reference).square())


def relative_errors(pairs: np.ndarray) -> np.ndarray:
    """[..., 2] (err^2, ref^2) sums -> sqrt(err^2 / ref^2); NaN where nothing was measured."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.sqrt(pairs[..., 0] / pairs[..., 1])


def low_quantized(low_path, kind: str, original, run_path, computed, group):
    """The low path's quantization of operand `kind` (input, weight, grad, saved_input):
    the tensor the running path made when it is the low path's, else quantized here (a unit
    on the recovery path is measured in the shadow: as if it ran the low path). None: the
    low path leaves this operand unquantized."""
    spec = getattr(low_path, kind)
    if spec is None:
        return None
    if getattr(run_path, kind) == spec:
        return computed
    return quantize(original, spec, amax_group=group)


class Measurement(Protocol):
    """A measured quantity; subclass it (the hooks default to measuring nothing)."""

    name: str
    """Its `--gnmr-measure` name, the trace's key and what a signal's `observes` names."""
    slots: int
    """float64 sums per unit it adds into."""
    keeps_exact_input = False
    """Whether `weight_gradient` needs the unquantized GEMM input (kept alive until backward
    for the probed units: memory)."""
    damage_rank: int | None = None
    """How directly it measures the low path's damage, for `megatron-gnmr calibrate`'s choice
    among the recorded ones (lower first; None: not a damage measure)."""
    watches = "linear"
    """The units it measures: `linear` (the unit linears' GEMMs, where a precision recipe
    quantizes) or `attention` (the core attention's low-cost path)."""
    reads_output = False
    """Whether `attention_operands` wants O (`o`: O and the low path's hold of it, made in the
    shadow where the unit runs exact), besides the operands FP8 attention quantizes."""

    def forward(self, slots: Slots, low_path, x, weight, run_path, x_q, w_q, saved,
                group) -> None:
        """The forward GEMM: exact input and weight, the run path's quantized ones, and what
        the weight gradient will read (`saved`)."""

    def output_gradient(self, slots: Slots, low_path, grad_output, run_path, g_q,
                        group) -> None:
        """The backward: the output gradient and the run path's quantized one."""

    def weight_gradient(self, slots: Slots, low_path, grad_output, x_exact, run_path,
                        grad_weight, group) -> None:
        """The weight gradient the run path computed (called when `keeps_exact_input`)."""

    def attention_operands(self, slots: Slots, low_path, run_path, operands: dict,
                           group) -> None:
        """The core attention's FP8 operands (`q`, `k`, `v`, `p` in the forward, `do` in the
        backward, one call each): name -> (the exact tensor, what the run path holds).
        `low_path`, `run_path`: `flash_attention.AttentionPath`s."""

    def attention_delta(self, slots: Slots, low_path, run_path, probabilities, grad_p,
                        grad_out, out, group) -> None:
        """The attention backward's delta stage: P (softmax), dP = dO V^T, the dO it used and
        the exact output O; the run computed delta = rowsum(dO * O as the path holds it)."""

    def attention_kernel(self, slots: Slots, view) -> None:
        """The attention call as a production kernel exposes it (`kernel_view.KernelView`:
        Q, K, V as read, O as stored, dO, the backward's delta), on the path the unit ran."""

    def value(self, sums: np.ndarray) -> np.ndarray:
        """[units, slots] all-reduced sums -> [units] values (NaN: not measured)."""
        ...
