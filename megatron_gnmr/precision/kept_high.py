"""The units a run keeps on the recovery path in every step, statically: those Megatron's
`--te-precision-config-file` forces to BF16 (`--precision-config-file`) and those of the first
and last layers (Megatron's `--first-last-layers-bf16`, `--num-layers-at-start-in-bf16`,
`--num-layers-at-end-in-bf16`: the whole layer's linears, the units of those layers here)."""

from __future__ import annotations

import re

from megatron_gnmr.precision.precision_config_file import file_units, high_precision_units

_LAYER = re.compile(r"layers\.(\d+)\.")


def _layer(unit: str) -> int | None:
    match = _LAYER.match(unit)
    return int(match.group(1)) if match else None


def first_last_layer_units(precision, units: list[str]) -> list[str]:
    """The units of the first and last layers `--first-last-layers-bf16` keeps high."""
    if not precision.first_last_layers_bf16:
        return []
    layers = [layer for layer in map(_layer, units) if layer is not None]
    if not layers:
        return []
    count = max(layers) + 1
    start, end = precision.num_layers_at_start_in_bf16, precision.num_layers_at_end_in_bf16
    kept = set(range(min(start, count))) | set(range(max(count - end, 0), count))
    return [unit for unit in units if _layer(unit) in kept]


def kept_high(precision, units: list[str]) -> frozenset[str]:
    """The units a run keeps on the recovery path in every step (none by default)."""
    kept = set(first_last_layer_units(precision, units))
    if precision.precision_config_file:
        kept |= set(high_precision_units(precision.precision_config_file, file_units(units)))
    return frozenset(kept)
