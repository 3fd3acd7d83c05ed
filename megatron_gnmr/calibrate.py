"""`megatron-gnmr calibrate RUN_DIR`: the units to keep in BF16 (`controller/calibrate.py`
ranks them), written as the precision config Megatron reads. A command at the top, as
`estimate.py` is, rather than in controller/: a budget in FLOPs needs the run's own config
(`config.json`), which the controller layer does not read."""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_gnmr.controller.calibrate import (
    rank_units,
    units_for_budget,
    units_for_flop_budget,
)
from megatron_gnmr.errors import UserError


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
    parser.epilog = (
        "Which rule to use (docs/results.md section 12, 8 layers x 128, 4 seeds, two "
        "stresses): the first layer alone (Megatron's --first-last-layers-bf16 "
        "--num-layers-at-end-in-bf16 0; 12.5% of the GEMM FLOPs) recovered 0.89 and 0.87 of "
        "the loss gap; with --precision-recovery-gemms wgrad the same at 4.2% where only the "
        "backward is quantized (saved activations), nothing where the forward is (W8A2). "
        "This ranking by the oracle's measured error recovered 0.82 and 0.11 at 12.5%, by the "
        "first-order loss cost (W8A2) 0.70, and the last layer -0.09 and 0.23. Start from "
        "the first layer; calibrate what remains, and check it against the first layer alone "
        "on paired seeds (megatron-gnmr compare-frontier).")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run traced with --gnmr-measure")
    parser.add_argument("--budget", type=float, default=0.125,
                        help="share of the units' GEMM FLOPs (or of the units, with "
                        "--budget-in units) to keep in BF16 (default 0.125)")
    parser.add_argument("--budget-in", choices=("flops", "units"), default="flops",
                        help="what --budget is a share of (default: flops)")
    parser.add_argument("--gemms", default="fprop,dgrad,wgrad",
                        help="the GEMMs each kept unit keeps high, as the run's "
                        "--precision-recovery-gemms (default: all three)")
    parser.add_argument("--first-layers", type=int, default=0, metavar="N",
                        help="keep the units of the first N layers before any ranked unit "
                        "(production's first-layer rule, with the rest of the budget "
                        "calibrated; default 0)")
    parser.add_argument("--measure", default=None, metavar="NAME",
                        help="the recorded measurement to rank by (default: the one closest "
                        "to the damage: loss_cost, oracle, qerr)")
    parser.add_argument("--out", default=None, help="the YAML to write (default: "
                        "RUN_DIR/precision_config.yaml)")


def run(args: argparse.Namespace) -> Path:
    from megatron_gnmr.controller.trace import read_trace
    from megatron_gnmr.precision import precision_config_file

    if not 0 < args.budget <= 1:
        raise UserError(f"calibrate --budget {args.budget}: use a share in (0, 1]")
    trace = read_trace(str(Path(args.run_dir) / "gnmr_trace.jsonl"))
    measure, ranked = rank_units(trace, args.measure)
    if args.first_layers:
        first = tuple(f"layers.{layer}." for layer in range(args.first_layers))
        ranked = [r for r in ranked if r[0].startswith(first)] + \
            [r for r in ranked if not r[0].startswith(first)]
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
    first = f" --first-layers {args.first_layers}" if args.first_layers else ""
    precision_config_file.write(
        str(out), chosen,
        note=f"megatron-gnmr calibrate {args.run_dir} --budget {args.budget} --budget-in "
             f"{args.budget_in}{first}: the {len(chosen)} of {len(ranked)} units\n"
             f"({100 * share:.1f}% of the {args.budget_in}){gemms} with the largest mean {measure} over "
             f"{len(trace.steps)} traced steps, kept in BF16.\nMegatron: "
             f"--te-precision-config-file FILE; megatron-gnmr: --precision-config-file FILE")
    print(f"calibrate: ranked {len(ranked)} units by mean {measure} over "
          f"{len(trace.steps)} steps; keeping {len(chosen)} ({100 * share:.1f}% of the "
          f"{args.budget_in}){gemms} in BF16:")
    for unit, damage in ranked[:len(chosen)]:
        print(f"  {unit:48s} {damage:.4g}")
    print(f"calibrate: {out}")
    return out
