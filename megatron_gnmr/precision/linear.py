"""Megatron's column/row parallel linears, with the GEMM routed through the unit's path.

Built through the layer `ModuleSpec` (`emulated_layer_spec`), so the transformer layer is
not forked. Each unit's linear is bound to the run's `PrecisionRuntime` after the model is
built; on every forward it asks which path its unit runs in this step. An exact path (the
recovery path of a BF16-recovery recipe) calls megatron's own `_forward_impl` untouched,
unless the unit is probed (`precision/probes.py`): then the exact GEMMs run in the emulated
function, which can measure the low path alongside.
"""

from __future__ import annotations

from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from megatron_gnmr.precision.kernels import KERNELS


class _PathRoutedLinear:
    unit_name: str | None = None
    precision_runtime = None

    def _forward_impl(self, input, weight, *args, **kwargs):
        runtime = self.precision_runtime
        path = runtime.path_for(self.unit_name) if runtime is not None else None
        # Probes measure training steps only: an evaluation's forward passes must not enter
        # the next step's sums.
        probe = runtime.probe_for(self.unit_name) if runtime is not None and self.training \
            else None
        if path is None or (path.is_exact and probe is None):
            return super()._forward_impl(input, weight, *args, **kwargs)
        allreduce_dgrad = bool(kwargs.get("allreduce_dgrad"))
        if kwargs.get("sequence_parallel"):
            # A column-parallel linear under sequence parallelism: gather the sequence here
            # (its backward reduce-scatters the input gradient), then the GEMMs see the whole
            # input, as with plain TP but without the input-gradient all-reduce.
            input = gather_from_sequence_parallel_region(input, group=self.tp_group)
            allreduce_dgrad = False
        return KERNELS[path.kernel](input, weight, kwargs.get("bias"), path, allreduce_dgrad,
                                    self.tp_group, probe, self.parallel)


class EmulatedColumnParallelLinear(_PathRoutedLinear, ColumnParallelLinear):
    parallel = "column"  # weight and output split along N


class EmulatedRowParallelLinear(_PathRoutedLinear, RowParallelLinear):
    parallel = "row"  # weight and input split along K


def path_routed(linear: type) -> type:
    """megatron's local linear class -> its path-routed subclass."""
    return EmulatedRowParallelLinear if issubclass(linear, RowParallelLinear) \
        else EmulatedColumnParallelLinear


def emulated_layer_spec(spec, family):
    """A copy of a local-spec transformer layer with its unit linears (the family's attention
    linears, the MLP's) path-routed."""
    from megatron_gnmr.model_families import route_unit_linears

    return route_unit_linears(spec, family, path_routed)
