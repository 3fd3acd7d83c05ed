"""`megatron-gnmr compare-held-out SCENARIO`: the detection study's held-out round, judged once.

The scenario (configs/scenarios/attention_detection_heldout.yaml) runs per seed the `twin`
(the fault, no control), the `healthy` run, `exact-attention`, and each rule fixed on the
training seeds (its variant's flags; a rule is a variant with a `healthy-<rule>` twin of its
own). From the committed per-run summaries and the twins' and healthy runs' detection traces:

- on the fault, per rule: runs saved unharmed where the twin died (not diverged, and the final
  loss, mean of the last 300 steps, within the harm margin of exact attention's of the same
  seed: twice exact attention's seed-to-seed SD), the attention FLOPs it ran exact, its first
  recovery's lead over the twin's death and over the onset of harm (`detection.harm_onset`);
- on the healthy run, per rule: whether it would act (its replay on the healthy trace, the
  live policy's own decisions: a controlled run is the healthy run bit for bit until its first
  action); where it does, the live `healthy-<rule>` run says what it spent and did; where it
  does not, it spends nothing;
- Fisher's exact test, one-sided in both directions, of the rules' failures on the fault and of
  their healthy runs with any recovery.
Writes DIR/held_out.{md,json} and the report image of one seed (DIR/held_out.png).
"""

from __future__ import annotations

import argparse
import json
import statistics

from megatron_gnmr.errors import UserError
from megatron_gnmr.experiments import detection, detection_traces
from megatron_gnmr.experiments.closed_loop_runs import run_summary
from megatron_gnmr.experiments.closed_loop_statistics import (
    fisher_one_sided,
    harm_margin,
    mean_and_standard_error,
)
from megatron_gnmr.experiments.run_summaries import add_location_arguments, collect, locations

TWIN, HEALTHY, EXACT = "twin", "healthy", "exact-attention"


def rules_of(scenario) -> list[str]:
    return [v for v in scenario.variants if f"{HEALTHY}-{v}" in scenario.variants]


def first_recovery(trace, scenario, rule: str, seed: int) -> tuple[int | None, tuple[int, ...]]:
    """The step the rule's first recovery would come on this trace (None: never) and the units
    it would recover, replayed with the live run's own policy and signal settings (the
    variant's flags parsed)."""
    from megatron_gnmr.arguments import parse_config
    from megatron_gnmr.controller.replay import Decisions

    flags = [*scenario.base, *scenario.variants[rule], "--seed", str(seed)]
    gnmr = parse_config(flags).gnmr
    for step, decision in zip(trace.steps, Decisions(trace, gnmr.policy_config(),
                                                     gnmr.signal_settings(seed))):
        if decision.recovery:
            return step + 1, decision.recovery
    return None, ()


def fires_on(trace, scenario, rule: str, seed: int) -> int | None:
    """The step the rule's first recovery would come on this trace (None: never)."""
    return first_recovery(trace, scenario, rule, seed)[0]


def judge(scenario, table: dict, traces: dict) -> dict:
    exact = table.get(EXACT, {})
    finals = [r["final_train_loss"] for r in exact.values() if r["diverged_at"] is None]
    if len(finals) < 2:
        raise UserError("compare-held-out: needs two finished exact-attention runs or more")
    margin = harm_margin(finals)
    twins = table.get(TWIN, {})
    # a seed counts once its twin and healthy run have traces (detection is a function of
    # them); the live arms judge harm only against an exact-attention run of the same seed
    seeds = sorted(s for s in twins if (TWIN, s) in traces and (HEALTHY, s) in traces)
    healthy_finals = [float(sum(traces[HEALTHY, s].loss[-300:]) / 300) for s in seeds]
    onset_margin = harm_margin(healthy_finals) if len(healthy_finals) > 1 else margin
    out = {"seeds": seeds, "harm_margin": margin, "rules": {}}
    for rule in rules_of(scenario):
        runs, alone = table.get(rule, {}), table.get(f"{HEALTHY}-{rule}", {})
        per_seed = {}
        for seed in seeds:
            twin, run = twins[seed], runs.get(seed)
            onset = detection.harm_onset(traces[TWIN, seed].loss, traces[HEALTHY, seed].loss,
                                         onset_margin) if twin["diverged_at"] else None
            fires = fires_on(traces[HEALTHY, seed].trace, scenario, rule, seed)
            live = alone.get(seed)
            per_seed[seed] = {
                "twin_died_at": twin["diverged_at"], "onset": onset,
                "ran": run is not None,
                "diverged": run is not None and run["diverged_at"] is not None,
                "gap": None if run is None or run["diverged_at"] is not None or seed not in exact
                else run["final_train_loss"] - exact[seed]["final_train_loss"],
                "spent": run["recovered_share_of_executed_steps"] if run else None,
                "first_recovery": run["first_recovery"] if run else None,
                "healthy_fires_at": fires,
                "healthy_spent": 0.0 if fires is None else
                (live["recovered_share_of_executed_steps"] if live else None),
            }
            verdict = per_seed[seed]
            verdict["judged"] = verdict["ran"] and (verdict["diverged"] or seed in exact)
            verdict["failed"] = verdict["judged"] and (verdict["diverged"] or (
                verdict["gap"] is not None and verdict["gap"] > margin))
        out["rules"][rule] = per_seed
    return out


def _mean_se(values, percent=False) -> str:
    values = [v for v in values if v is not None]
    result = mean_and_standard_error(values)
    if result is None:
        return "-"
    scale = 100.0 if percent else 1.0
    unit = "%" if percent else ""
    return f"{scale * result[0]:.1f}{unit} +- {scale * result[1]:.1f}{unit} (n={len(values)})" \
        if percent else f"{result[0]:+.3f} +- {result[1]:.3f} (n={len(values)})"


def _median(values) -> str:
    values = [v for v in values if v is not None]
    return f"{statistics.median(values):.0f}" if values else "-"


def table_lines(result: dict) -> list[str]:
    lines = ["| rule | dying runs saved unharmed | failed (diverged or harmed) | attention "
             "FLOPs exact, dying runs | first recovery (median step) | lead over the twin's "
             "death (median) | lead over the onset of harm (median) | healthy runs it acts on "
             "| attention FLOPs exact, healthy runs | final loss gap to exact |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for rule, seeds in result["rules"].items():
        ran = {s: v for s, v in seeds.items() if v["judged"] and v["twin_died_at"]}
        lines.append(
            f"| {rule} | {sum(not v['failed'] for v in ran.values())} / {len(ran)} | "
            f"{sum(v['failed'] for v in ran.values())} / {len(ran)} | "
            f"{_mean_se([v['spent'] for v in ran.values()], percent=True)} | "
            f"{_median(v['first_recovery'] for v in ran.values())} | "
            f"{_median(v['twin_died_at'] - v['first_recovery'] for v in ran.values() if v['first_recovery'])} | "
            f"{_median(v['onset'] - v['first_recovery'] for v in ran.values() if v['first_recovery'] and v['onset'])} | "
            f"{sum(v['healthy_fires_at'] is not None for v in seeds.values())} / {len(seeds)} | "
            f"{_mean_se([v['healthy_spent'] for v in seeds.values()], percent=True)} | "
            f"{_mean_se([v['gap'] for v in ran.values()])} |")
    rules = list(result["rules"])
    lines += ["", "Fisher's exact test, one-sided, each direction (p that the first fails / "
              "acts on healthy runs less often than the second):", "",
              "| first | second | failed on the fault | acted on a healthy run |", "|---|---|---|---|"]
    for a in rules:
        for b in rules:
            if a == b:
                continue
            cells = []
            for key in ("failed", "healthy"):
                def count(rule):
                    seeds = result["rules"][rule]
                    if key == "failed":
                        ran = [v for v in seeds.values()
                               if v["judged"] and v["twin_died_at"]]
                        return sum(v["failed"] for v in ran), len(ran)
                    return sum(v["healthy_fires_at"] is not None for v in seeds.values()), \
                        len(seeds)
                (x, n), (y, m) = count(a), count(b)
                cells.append(f"{x}/{n} vs {y}/{m}, p = {fisher_one_sided(x, n, y, m):.3g}")
            lines.append(f"| {a} | {b} | {cells[0]} | {cells[1]} |")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="the held-out scenario (attention_detection_heldout)")
    add_location_arguments(parser)
    parser.add_argument("--plot-seed", type=int, default=None,
                        help="the seed of the report image (default: the first)")


def run(args: argparse.Namespace) -> dict:
    from megatron_gnmr.experiments.held_out_plot import plot_seed

    scenario, runs, summaries = locations(args)
    table = collect(scenario, runs, summaries, run_summary)
    if runs.is_dir():
        detection.collect(scenario, runs, summaries / "traces")
    traces = {}
    for path in sorted((summaries / "traces").glob("*.npz")):
        variant, _, seed = path.stem.rpartition("-seed")
        traces[variant, int(seed)] = detection_traces.read(path)
    result = judge(scenario, table, traces)
    cpus = sorted({r.get("cpu") or "?" for arm in table.values() for r in arm.values()})
    lines = [f"Held-out seeds {', '.join(map(str, result['seeds']))}; harm margin "
             f"{result['harm_margin']:.4f} (twice exact attention's seed-to-seed SD of the "
             "final loss).", "", *table_lines(result), "",
             f"Runs made on: {', '.join(cpus)}."]
    (summaries / "held_out.md").write_text("\n".join(lines) + "\n")
    (summaries / "held_out.json").write_text(json.dumps(result, indent=1) + "\n")
    if result["seeds"]:
        seed = args.plot_seed if args.plot_seed is not None else result["seeds"][0]
        plot_seed(table, result, seed, summaries / "held_out.png")
    print("\n".join(lines))
    return result
