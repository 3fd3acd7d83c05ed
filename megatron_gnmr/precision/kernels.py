"""How a path's quantized GEMMs run (`GemmPath.kernel`): the registry.

A kernel is called by every path-routed linear whose unit runs that path, as
`kernel(x, weight, bias, path, allreduce_dgrad, tp_group, probe, parallel)`, and returns the
linear's output (its autograd function does the backward GEMMs). `emulated` fake-quantizes
the operands and runs float GEMMs (`paths.py`); `torchao` runs real FP8 GEMMs
(`torchao_linear.py`). A study with its own GEMM arithmetic (the E4M3 question's independent
implementation) registers a kernel of its own here and names it in its recipe's paths,
instead of patching the project's functions.
"""

from __future__ import annotations

from typing import Protocol

from megatron_gnmr.precision.paths import emulated_linear


class GemmKernel(Protocol):
    def __call__(self, x, weight, bias, path, allreduce_dgrad: bool, tp_group, probe,
                 parallel: str | None):
        """The linear's output for input `x` (autograd through the kernel's own function).
        `path`: the unit's `GemmPath` this step; `allreduce_dgrad`: sum the input gradient
        over `tp_group` (column-parallel); `parallel`: the TP split, column, row or None.
        `probe` (a `probes.UnitProbe`, or None): a kernel calls its `forward_operands` and
        `grad_operand` with the exact and the path's quantized operands, and its
        `weight_gradient` with the exact input when `probe.keeps_exact_input`, so every
        measured quantity sees this kernel's arithmetic."""


def _emulated(x, weight, bias, path, allreduce_dgrad, tp_group, probe, parallel):
    return emulated_linear(x, weight, bias, path, allreduce_dgrad, tp_group, probe,
                           parallel=parallel)


def _torchao(x, weight, bias, path, allreduce_dgrad, tp_group, probe, parallel):
    from megatron_gnmr.precision.torchao_linear import torchao_linear

    return torchao_linear(x, weight, bias, path, allreduce_dgrad, tp_group, parallel, probe)


KERNELS: dict[str, GemmKernel] = {"emulated": _emulated, "torchao": _torchao}
