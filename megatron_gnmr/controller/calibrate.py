"""Which units to keep in high precision: the ranking and the budget rules behind
`megatron-gnmr calibrate RUN_DIR` (the command: `megatron_gnmr/calibrate.py`).

From a run traced with `--gnmr-measure` (loss_cost, oracle or qerr), every unit's damage is
its mean measured damage of the low path over the traced steps: the first-order loss cost of
its forward rounding where recorded, else the oracle (the low path's weight gradient against
the exact one), else qerr (its operands' rounding error); `--measure` picks one.
The most damaged units, as many as the budget allows, are written as a
`--te-precision-config-file` YAML keeping them in BF16: Megatron with Transformer Engine reads
it as it is, and our runs read it with `--precision-config-file` (the calibrated static
baseline; with `--gnmr`, the controller's choices come on top).

The budget is a share of the units' GEMM FLOPs (`--budget-in flops`, the default; fc1 costs
about twice fc2 here) or of the units (`--budget-in units`: the nearest whole number). With
`--gemms wgrad` only the kept units' weight-gradient GEMMs are paid for (a third of each
unit), so the same budget keeps three times the units; the run that reads the file then
needs `--precision-recovery-gemms wgrad` (Megatron's file cannot say it).

A short measured run is enough to start from, e.g. 100 steps of
`pretrain_llama.py ... --gnmr --gnmr-measure qerr,oracle --save RUN_DIR`.
"""

from __future__ import annotations

import numpy as np

from megatron_gnmr.errors import UserError
from megatron_gnmr.precision.measurements import MEASUREMENTS


def rank_units(trace, measure: str | None = None) -> tuple[str, list[tuple[str, float]]]:
    """(the measure used, [(unit, mean damage)] most damaged first): `measure`'s values, or
    those of the recorded damage measure that stands closest to the damage
    (`Measurement.damage_rank`: the first-order loss cost, then the oracle, then qerr)."""
    damage_measures = [measure] if measure else [
        name for _, name in sorted((m.damage_rank, name) for name, m in MEASUREMENTS.items()
                                   if m.damage_rank is not None)]
    for measure in damage_measures:
        values = trace.measured.get(measure)
        if values is not None and np.isfinite(values).any():
            break
    else:
        raise UserError(f"calibrate: the trace has no measured {' or '.join(damage_measures)} "
                        f"values; record them with --gnmr --gnmr-measure "
                        f"{','.join(damage_measures)}")
    with np.errstate(invalid="ignore"):
        damage = np.nanmean(np.where(np.isfinite(values), values, np.nan), axis=0)
    order = np.argsort(-np.nan_to_num(damage, nan=-np.inf), kind="stable")
    return measure, [(trace.units[i], float(damage[i])) for i in order]


def units_for_budget(ranked: list[tuple[str, float]], budget: float) -> list[str]:
    """The top units, as many as the nearest whole number to budget x units (>= 1)."""
    count = max(1, round(budget * len(ranked)))
    return [unit for unit, _ in ranked[:count]]


def units_for_flop_budget(ranked: list[tuple[str, float]], costs: dict[str, float],
                          budget: float) -> list[str]:
    """The most damaged units whose costs (shares of all units' GEMM FLOPs) fit `budget`,
    most damaged first; a unit that does not fit is passed over for the next that does."""
    chosen, spent = [], 0.0
    for unit, _ in ranked:
        if spent + costs[unit] <= budget + 1e-9:
            chosen.append(unit)
            spent += costs[unit]
    return chosen
