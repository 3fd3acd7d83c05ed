"""`megatron-gnmr calibrate RUN_DIR`: which units to keep in high precision, as the
precision config Megatron reads.

From a run traced with `--gnmr-measure oracle` (or `qerr`), every unit's damage is its mean
measured error of the low path over the traced steps: the oracle (the low path's weight
gradient against the exact one) where recorded, else qerr (its operands' rounding error).
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

import argparse
from pathlib import Path

import numpy as np

from megatron_gnmr.errors import UserError


def rank_units(trace) -> tuple[str, list[tuple[str, float]]]:
    """(the measure used, [(unit, mean damage)] most damaged first)."""
    for measure in ("oracle", "qerr"):
        values = trace.signals.get(measure)
        if values is not None and np.isfinite(values).any():
            break
    else:
        raise UserError("calibrate: the trace has no measured error; record one with "
                        "--gnmr --gnmr-measure qerr,oracle")
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


def flop_shares(run_dir: Path, units: list[str], gemms: str) -> dict[str, float]:
    """Each unit's share of all units' GEMM FLOPs when it keeps `gemms` high, from the
    run's own config."""
    import json

    from megatron_gnmr.config import RunConfig
    from megatron_gnmr.controller.units import UnitShape
    from megatron_gnmr.precision.unit_costs import RecoveredShare

    path = run_dir / "config.json"
    if not path.is_file():
        raise UserError(f"calibrate {run_dir}: no config.json, so no unit costs for a budget "
                        "in FLOPs (use --budget-in units)")
    config = RunConfig.from_dict(json.loads(path.read_text()))
    config.precision.precision_recovery_gemms = gemms
    share = RecoveredShare(config, UnitShape.of_run(config).names())
    scaled = share.budget_costs(units)
    return {unit: cost / len(units) for unit, cost in zip(units, scaled)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run traced with --gnmr-measure")
    parser.add_argument("--budget", type=float, default=0.125,
                        help="share of the units' GEMM FLOPs (or of the units, with "
                        "--budget-in units) to keep in BF16 (default 0.125)")
    parser.add_argument("--budget-in", choices=("flops", "units"), default="flops",
                        help="what --budget is a share of (default: flops)")
    parser.add_argument("--gemms", default="fprop,dgrad,wgrad",
                        help="the GEMMs each kept unit keeps high, as the run's "
                        "--precision-recovery-gemms (default: all three)")
    parser.add_argument("--out", default=None, help="the YAML to write (default: "
                        "RUN_DIR/precision_config.yaml)")


def run(args: argparse.Namespace) -> Path:
    from megatron_gnmr.controller.trace import read_trace
    from megatron_gnmr.precision import precision_config_file

    if not 0 < args.budget <= 1:
        raise UserError(f"calibrate --budget {args.budget}: use a share in (0, 1]")
    trace = read_trace(str(Path(args.run_dir) / "gnmr_trace.jsonl"))
    measure, ranked = rank_units(trace)
    if args.budget_in == "units":
        chosen = units_for_budget(ranked, args.budget)
        share = len(chosen) / len(ranked)
    else:
        costs = flop_shares(Path(args.run_dir), [unit for unit, _ in ranked], args.gemms)
        chosen = units_for_flop_budget(ranked, costs, args.budget)
        share = sum(costs[unit] for unit in chosen)
    gemms = "" if set(args.gemms.split(",")) == {"fprop", "dgrad", "wgrad"} else \
        f" (their {args.gemms} GEMMs: run with --precision-recovery-gemms {args.gemms})"
    out = Path(args.out) if args.out else Path(args.run_dir) / "precision_config.yaml"
    precision_config_file.write(
        str(out), chosen,
        note=f"megatron-gnmr calibrate {args.run_dir} --budget {args.budget} --budget-in "
             f"{args.budget_in}: the {len(chosen)} of {len(ranked)} units\n({100 * share:.1f}% "
             f"of the {args.budget_in}){gemms} with the largest mean {measure} over "
             f"{len(trace.steps)} traced steps, kept in BF16.\nMegatron: "
             f"--te-precision-config-file FILE; megatron-gnmr: --precision-config-file FILE")
    print(f"calibrate: ranked {len(ranked)} units by mean {measure} over "
          f"{len(trace.steps)} steps; keeping {len(chosen)} ({100 * share:.1f}% of the "
          f"{args.budget_in}){gemms} in BF16:")
    for unit, damage in ranked[:len(chosen)]:
        print(f"  {unit:48s} {damage:.4g}")
    print(f"calibrate: {out}")
    return out
