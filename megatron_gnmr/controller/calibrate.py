"""`megatron-gnmr calibrate RUN_DIR`: which units to keep in high precision, as the
precision config Megatron reads.

From a run traced with `--gnmr-measure oracle` (or `qerr`), every unit's damage is its mean
measured error of the low path over the traced steps: the oracle (the low path's weight
gradient against the exact one) where recorded, else qerr (its operands' rounding error).
The most damaged units, as many as the budget allows (the nearest whole number of units),
are written as a `--te-precision-config-file` YAML keeping them in BF16: Megatron with
Transformer Engine reads it as it is, and our runs read it with `--precision-config-file`
(the calibrated static baseline; with `--gnmr`, the controller's choices come on top).

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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run traced with --gnmr-measure")
    parser.add_argument("--budget", type=float, default=0.1,
                        help="share of the units to keep in BF16 (default 0.1)")
    parser.add_argument("--out", default=None, help="the YAML to write (default: "
                        "RUN_DIR/precision_config.yaml)")


def run(args: argparse.Namespace) -> Path:
    from megatron_gnmr.controller.trace import read_trace
    from megatron_gnmr.precision import precision_config_file

    if not 0 < args.budget <= 1:
        raise UserError(f"calibrate --budget {args.budget}: use a share in (0, 1]")
    trace = read_trace(str(Path(args.run_dir) / "gnmr_trace.jsonl"))
    measure, ranked = rank_units(trace)
    chosen = units_for_budget(ranked, args.budget)
    out = Path(args.out) if args.out else Path(args.run_dir) / "precision_config.yaml"
    share = len(chosen) / len(ranked)
    precision_config_file.write(
        str(out), chosen,
        note=f"megatron-gnmr calibrate {args.run_dir} --budget {args.budget}: the {len(chosen)} "
             f"of {len(ranked)} units ({100 * share:.1f}%)\nwith the largest mean {measure} "
             f"over {len(trace.steps)} traced steps, kept in BF16.\nMegatron: "
             f"--te-precision-config-file FILE; megatron-gnmr: --precision-config-file FILE")
    print(f"calibrate: ranked {len(ranked)} units by mean {measure} over "
          f"{len(trace.steps)} steps; keeping {len(chosen)} ({100 * share:.1f}%) in BF16:")
    for unit, damage in ranked[:len(chosen)]:
        print(f"  {unit:48s} {damage:.4g}")
    print(f"calibrate: {out}")
    return out
