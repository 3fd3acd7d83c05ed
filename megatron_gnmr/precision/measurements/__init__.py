"""Measured quantities: the registry behind `--gnmr-measure` and the probed risk signals.

Each entry is a `base.Measurement`: where it watches the GEMMs, how many float64 sums per unit
it adds (they ride in the controller's one statistics all-reduce) and how the sums become one
value per unit. The trace records the values by name and replay reads them back by name, so a
new measurement is one file and one line here (docs/architecture.md shows one).
"""

from __future__ import annotations

import numpy as np

from megatron_gnmr.precision.measurements.attention_delta_bias import (
    AttentionDeltaBias,
    OutputRoundingBias,
)
from megatron_gnmr.precision.measurements.attention_delta_error import AttentionDeltaError
from megatron_gnmr.precision.measurements.base import Measurement, Slots
from megatron_gnmr.precision.measurements.first_order_loss import (
    FirstOrderLossCost,
    GrossFirstOrderLossCost,
)
from megatron_gnmr.precision.measurements.fp8_tensor_quality import (
    FP8MeanSquaredError,
    FP8MeanSquaredErrorWithOutput,
    FP8Underflow,
    FP8UnderflowWithOutput,
)
from megatron_gnmr.precision.measurements.kernel_probe import (
    KernelDeltaBias,
    KernelDeltaError,
    KernelOutputBias,
    KernelProbeCost,
)
from megatron_gnmr.precision.measurements.quantization_error import QuantizationError
from megatron_gnmr.precision.measurements.weight_gradient_error import WeightGradientError

MEASUREMENTS: dict[str, Measurement] = {
    m.name: m for m in (QuantizationError(), WeightGradientError(), FirstOrderLossCost(),
                        GrossFirstOrderLossCost(), AttentionDeltaError(), FP8Underflow(),
                        FP8MeanSquaredError(), AttentionDeltaBias(),
                        OutputRoundingBias(), FP8UnderflowWithOutput(),
                        FP8MeanSquaredErrorWithOutput(), KernelOutputBias(),
                        KernelDeltaBias(), KernelDeltaError(), KernelProbeCost())}

# Keys a trace record already uses (controller/trace.py): no measurement may take them.
RESERVED = frozenset({"type", "step", "norms", "recovery", "alarmed"})

__all__ = ["MEASUREMENTS", "Measurement", "Slots", "in_registry_order", "layout", "parse_measured",
           "values", "watching"]


def parse_measured(text: str) -> tuple[str, ...]:
    """`--gnmr-measure`'s comma list -> the names, in registry order. ValueError names the
    unknown ones."""
    names = {n.strip() for n in text.split(",") if n.strip()}
    unknown = names - set(MEASUREMENTS)
    if unknown:
        raise ValueError(f"gnmr.measure cannot measure {', '.join(sorted(unknown))}; "
                         f"use {', '.join(MEASUREMENTS)}")
    return in_registry_order(names)


def in_registry_order(names) -> tuple[str, ...]:
    """The slot layout's order: the same on every rank and in every reader."""
    wanted = set(names)
    return tuple(name for name in MEASUREMENTS if name in wanted)


def layout(names) -> list[tuple[Measurement, slice]]:
    """Each named measurement with its slots in a unit's row (registry order)."""
    out, start = [], 0
    for name in in_registry_order(names):
        measurement = MEASUREMENTS[name]
        if name in RESERVED:
            raise ValueError(f"measurement {name!r}: the trace uses that key")
        out.append((measurement, slice(start, start + measurement.slots)))
        start += measurement.slots
    return out


def values(names, sums: np.ndarray) -> dict[str, np.ndarray]:
    """[units, slots] all-reduced sums of the named measurements -> {name: [units] values}."""
    return {m.name: m.value(sums[:, where]) for m, where in layout(names)}


def watching(names, kind: str) -> tuple[str, ...]:
    """The named measurements that watch `kind` units (`linear` or `attention`)."""
    return tuple(name for name in in_registry_order(names)
                 if MEASUREMENTS[name].watches == kind)
