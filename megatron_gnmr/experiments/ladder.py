"""`megatron-gnmr compare-ladder SCENARIO`: the fault ladder's training round (issue 56),
judged from the committed summaries and traces alone.

The scenario (configs/scenarios/attention_ladder.yaml) runs per seed a twin per rung
(`twin-RUNG`: the rung on the layers its seed draws, no control, every candidate's quantity
traced), the `healthy` run and `exact-attention`. From them:
- **lethality** per rung: twins that diverged, and twins that lived but ended harmed (final
  loss, mean of the last 300 steps, above exact attention's of the same seed by more than the
  harm margin), at two margins: twice exact attention's seed-to-seed SD, and twice the healthy
  FP8 runs' (section 13's two);
- **what the probe sees**: the distribution of each kernel-probe value per unit-step on faulted
  layers (from the fault's start) and on the healthy runs' layers (`ladder_plot.py`);
- **every detector** of `detectors.LADDER_FAMILIES` replayed per rung on the twins and on the
  healthy runs (`detection.evaluate`: early and right, before death, false alarms), with its
  spend on the dying twins, the kernel probe's FLOPs included where it reads the probe;
- **the choice** (`choose_for_held_out`), made here and committed before any held-out seed:
  the rungs that kill (their twins died on at least half the seeds: `killing_rungs`), then
  among our detectors (the probe's families and GNMR; never the oracle, never TE's) the
  setting that fires on no healthy run and names the faulted layers before the onset of harm
  on the most dying twins of those rungs, then the best worst rung, then the longest median
  lead, then the highest threshold; TE's rule at its best by the same measure, per family
  (with and without the latch, with and without O).
Writes DIR/ladder.{md,json} and DIR/ladder.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict
from pathlib import Path

import numpy as np
from tqdm import tqdm

from megatron_gnmr.errors import UserError
from megatron_gnmr.experiments import detection, detection_traces
from megatron_gnmr.experiments.closed_loop_runs import run_summary
from megatron_gnmr.experiments.closed_loop_statistics import harm_margin
from megatron_gnmr.experiments.detectors import (
    LADDER_FAMILIES,
    ORACLE,
    Setting,
    settings,
    spend,
)
from megatron_gnmr.experiments.run_summaries import add_location_arguments, collect, locations

TWIN_PREFIX = "twin-"
HEALTHY, EXACT = detection.HEALTHY, "exact-attention"
TRACED = lambda variant: variant == HEALTHY or variant.startswith(TWIN_PREFIX)  # noqa: E731
PROBED = ("kernel_output_bias", "kernel_delta_bias", "kernel_delta_error")
OURS = ("probe-output-sign", "probe-delta-sign", "probe-delta-size", "probe-delta-size-median50",
        "gnmr-latch")
RIVALS = ("te-unit-latch", "te-unit-nolatch", "te-o-latch", "te-o-nolatch")


def rungs_of(scenario) -> list[str]:
    return [v[len(TWIN_PREFIX):] for v in scenario.variants if v.startswith(TWIN_PREFIX)]


def lethality(table: dict, rung: str, margins: dict) -> dict:
    """Per seed with a twin and an exact run: where the twin died, its final-loss gap to exact
    attention, and whether it ended harmed at each margin; the counts."""
    twins, exact = table.get(TWIN_PREFIX + rung, {}), table.get(EXACT, {})
    seeds = {}
    for seed, twin in sorted(twins.items()):
        if seed not in exact:
            continue
        gap = None if twin["diverged_at"] is not None else \
            twin["final_train_loss"] - exact[seed]["final_train_loss"]
        seeds[seed] = {"died_at": twin["diverged_at"], "gap": gap,
                       **{f"lethal_at_{name}": twin["diverged_at"] is not None or gap > margin
                          for name, margin in margins.items()}}
    counts = {key: sum(v[key] for v in seeds.values()) for key in
              (f"lethal_at_{name}" for name in margins)}
    return {"seeds": seeds, "died": sum(v["died_at"] is not None for v in seeds.values()),
            "judged": len(seeds), **counts}


def killing_rungs(rungs: dict[str, dict]) -> list[str]:
    """The rungs whose twins died on at least half their judged seeds; `rungs` holds
    `lethality`'s results.

    Harm without death does not count. Decided after the training round, before any held-out
    seed ran (a choice made after looking, reported as one): the first rule counted a twin
    lethal when it died or ended above exact attention by the deciding margin, and at that
    margin (0.0150) the unbiased control nearest1 was lethal on 3 of 7 seeds (+0.022, +0.016,
    +0.108), so harm alone did not separate a biased fault from chance; and the held-out
    round judges an arm only on the seeds whose twin died (`ladder_goal.dying_seeds`), so a
    rung that harms without killing (down2: 0 of 7 died) would run every arm for nothing
    judged. The margins still decide whether a saved run ended unharmed."""
    return [rung for rung, r in rungs.items() if r["judged"] and 2 * r["died"] >= r["judged"]]


def probe_spend(trace, setting: Setting) -> float:
    """The kernel probe's FLOPs as a share of the attention's over the trace, on the unit-steps
    the detector leaves on the low path (a recovered unit is not probed); 0 for a detector
    that does not read the probe."""
    family_signal = setting.controller(len(trace.units))[1]["signals"]
    if not family_signal.startswith("kernel_") or "kernel_probe_cost" not in trace.measured:
        return 0.0
    from megatron_gnmr.controller.replay import Decisions

    config, signal = setting.controller(len(trace.units))
    cost = np.nan_to_num(trace.measured["kernel_probe_cost"])
    low = np.ones(cost.shape, dtype=bool)
    for row, decision in enumerate(list(Decisions(trace, config, signal))[:-1]):
        low[row + 1, list(decision.recovery)] = False
    return float((cost * low).sum() / cost.size)


def _rows(traces: Path, rung: str, seeds) -> tuple[list, list, float]:
    cases, margin = detection.load_cases(traces, seeds, twin=TWIN_PREFIX + rung)
    rows = [detection.evaluate(setting, cases)
            for setting in tqdm(settings(among=LADDER_FAMILIES), desc=f"detectors, {rung}",
                                unit="setting", leave=False)]
    return cases, rows, margin


def _key(per_rung: dict[str, detection.Row]) -> tuple:
    """How a setting ranks over the lethal rungs: dying twins named early and right in all,
    then on its worst rung (as a share), then its median lead over the onset."""
    early = sum(r.early_and_right for r in per_rung.values())
    worst = min((r.early_and_right / r.dying if r.dying else 1.0) for r in per_rung.values())
    leads = [r.lead_over_onset for r in per_rung.values() if r.lead_over_onset is not None]
    return early, worst, statistics.median(leads) if leads else 0.0


def choose_for_held_out(by_setting: dict[str, dict[str, detection.Row]], lethal: list[str],
                        families) -> str | None:
    """The label of the best setting of `families` that fires on no healthy run, by `_key`
    over the lethal rungs (ties: the last of its family's grid, the highest threshold)."""
    quiet = [label for label, per_rung in by_setting.items()
             if per_rung and next(iter(per_rung.values())).family in families
             and all(r.healthy_fired == 0 for r in per_rung.values())]
    if not quiet or not lethal:
        return None
    return max(reversed(quiet), key=lambda label: _key(
        {rung: by_setting[label][rung] for rung in lethal}))


def collect_traces(scenario, runs: Path, traces: Path) -> None:
    """A detection trace of every finished twin and healthy run not yet committed."""
    for variant, seed, _ in scenario.runs(smoke=False):
        run_dir, path = runs / f"{variant}-seed{seed}", traces / f"{variant}-seed{seed}.npz"
        if TRACED(variant) and (run_dir / "summary.json").is_file() and not path.is_file():
            detection_traces.write(run_dir, path)


def judge(scenario, table: dict, traces: Path, seeds=None) -> dict:
    exact_finals = [r["final_train_loss"] for r in table.get(EXACT, {}).values()
                    if r["diverged_at"] is None]
    healthy_finals = [r["final_train_loss"] for r in table.get(HEALTHY, {}).values()
                      if r["diverged_at"] is None]
    if len(exact_finals) < 2 or len(healthy_finals) < 2:
        raise UserError("compare-ladder: needs two finished exact-attention and healthy runs "
                        "or more")
    margins = {"exact": harm_margin(exact_finals), "healthy": harm_margin(healthy_finals)}
    rungs = {rung: lethality(table, rung, margins) for rung in rungs_of(scenario)}
    lethal = killing_rungs(rungs)
    by_setting: dict[str, dict] = {}
    spends: dict[str, dict] = {}
    for rung in rungs:
        if not any(traces.glob(f"{TWIN_PREFIX}{rung}-seed*.npz")):
            continue
        cases, rows, _ = _rows(traces, rung, seeds)
        for row in rows:
            by_setting.setdefault(row.label, {})[rung] = row
        dying = [c for c in cases if c.died]
        for setting in settings(among=LADDER_FAMILIES):
            spends.setdefault(setting.label, {})[rung] = None if not dying else {
                "recovered": statistics.fmean(spend(c.twin.trace, setting) for c in dying),
                "probe": statistics.fmean(probe_spend(c.twin.trace, setting) for c in dying)}
    ranked_over = lethal or list(rungs)  # no rung kills: each family at its best anyway
    best = {family.name: choose_for_held_out(by_setting, ranked_over, (family.name,))
            for family in LADDER_FAMILIES}
    chosen = choose_for_held_out(by_setting, lethal, OURS)
    costs = [float(np.nanmean(detection_traces.read(path).trace.measured["kernel_probe_cost"]))
             for path in sorted(traces.glob(f"{HEALTHY}-seed*.npz"))]
    chosen_spends = [spends[chosen][rung]["recovered"] for rung in lethal
                     if chosen is not None and spends[chosen].get(rung) is not None]
    return {"margins": margins, "rungs": rungs,
            "lethal_rungs": lethal, "chosen": chosen,
            "chosen_spend": statistics.fmean(chosen_spends) if chosen_spends else None,
            "probe_share": statistics.fmean(costs) if costs else None,
            "rivals": {family: best[family] for family in RIVALS}, "best": best,
            "oracle": ORACLE,
            "settings": {label: {rung: {**asdict(row), "spend": spends[label].get(rung)}
                                 for rung, row in per_rung.items()}
                         for label, per_rung in by_setting.items()}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="the ladder scenario (attention_ladder)")
    add_location_arguments(parser)
    parser.add_argument("--seeds", nargs="+", type=int, default=None,
                        help="the seeds to judge on (default: every seed with traces)")


def run(args: argparse.Namespace) -> dict:
    from megatron_gnmr.experiments.ladder_report import write_report

    scenario, runs, summaries = locations(args)
    table = collect(scenario, runs, summaries, run_summary)
    traces = summaries / "traces"
    if runs.is_dir():
        collect_traces(scenario, runs, traces)
    if args.seeds:
        table = {variant: {s: r for s, r in by_seed.items() if s in args.seeds}
                 for variant, by_seed in table.items()}
    result = judge(scenario, table, traces, args.seeds)
    result["cpus"] = sorted({r.get("cpu") or "?" for arm in table.values() for r in arm.values()})
    (summaries / "ladder.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    write_report(result, traces, summaries / "ladder")
    print((summaries / "ladder.md").read_text())
    return result
