"""`megatron-gnmr compare-alarms SCENARIO`: every detector on every run of a fault scenario.

Reads the runs `megatron-gnmr reproduce SCENARIO` wrote, replays each run's logged signals
through each detector (`alarm_replay`), and tabulates per run and signal group the first
alarm step, next to the run's divergence step (`tables.divergence_step`):

- healthy runs are the scenario's reference variant (`control`, `healthy`): any alarm there
  is a false alarm;
- a fault switched on mid-run (`--attention-fault-start N`): an alarm before step N is a
  false alarm too;
- the reference band is leave-one-out: every run is judged against the healthy runs of the
  OTHER seeds, so a healthy run is never its own reference and every run gets the same
  number of references.
Lead time = divergence step - alarm step (positive: the alarm came first).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from megatron_gnmr.errors import UserError
from megatron_gnmr.experiments.alarm_replay import replay_alarms
from megatron_gnmr.experiments.scenario import Scenario, load_scenario, results_dir
from megatron_gnmr.experiments.tables import divergence_step
from megatron_gnmr.monitors.alarms import AlarmBook
from megatron_gnmr.monitors.detectors.reference_runs import signals_by_key
from megatron_gnmr.jsonl import read_jsonl

# Signal group -> (family, signal names): the first alarm of any layer's signal in the group.
GROUPS = {
    "D2": ("attention", ("H_D2_mean",)),
    "dW": ("attention", ("H_dWq", "H_dWk")),
    "router entropy": ("router", ("entropy_mean",)),
    "router weights": ("router", ("weight_similarity",)),
    "expert load": ("router", ("load_max_over_mean",)),
    "loss": ("loss", ("train_loss",)),
}


# The detectors compared: the three of `--monitor-detector`, and the trend model on a
# linear step axis (what the log axis is chosen over).
COMPARED = {
    "trend": {"detector": "trend"},
    "trend-linear": {"detector": "trend", "trend_axis": "linear"},
    "reference": {"detector": "reference"},
    "online": {"detector": "online"},
}


def _group_of(key: str) -> str | None:
    family, name = key.split("/")[0], key.split("/")[-1]
    return next((g for g, (f, names) in GROUPS.items() if f == family and name in names), None)


def fault_start(flags: list[str]) -> int:
    return int(flags[flags.index("--attention-fault-start") + 1]) \
        if "--attention-fault-start" in flags else 0


def compare(scenario: Scenario, out: Path, smoke: bool = False) -> dict:
    seeds = scenario.smoke_seeds if smoke else scenario.seeds
    runs = {}
    for variant in scenario.variants:
        for seed in seeds:
            path = out / f"{variant}-seed{seed}" / "metrics.jsonl"
            if not path.is_file():
                raise UserError(f"compare-alarms: {path} is missing; run `megatron-gnmr "
                                f"reproduce {scenario.name}` first")
            runs[(variant, seed)] = read_jsonl(path)
    healthy = scenario.reference
    rows = []
    for (variant, seed), records in runs.items():
        groups_present = {_group_of(key) for key in signals_by_key([records])} - {None}
        row = {"variant": variant, "seed": seed, "healthy": variant == healthy,
               "fault_start": None if variant == healthy else
               fault_start(scenario.variants[variant]),
               "divergence": divergence_step(records), "alarms": {}}
        for detector, settings in COMPARED.items():
            references = {}
            if detector == "reference":
                references = signals_by_key([runs[(healthy, s)] for s in seeds if s != seed])
            events = replay_alarms(records, AlarmBook(**settings, references=references))
            first = {group: None for group in GROUPS if group in groups_present}
            for event in events:
                group = _group_of(event["key"])
                if group in first and first[group] is None:
                    first[group] = event["step"]
            row["alarms"][detector] = first
        rows.append(row)
    return {"scenario": scenario.name, "healthy": healthy, "seeds": seeds,
            "rows": rows, "summary": summarize(rows)}


def _is_false(row: dict, step: int | None) -> bool:
    if step is None:
        return False
    return row["healthy"] or step < (row["fault_start"] or 0)


def summarize(rows: list[dict]) -> dict:
    """Per detector and group: false alarms, detections before divergence, median lead."""
    summary = {}
    for detector in COMPARED:
        for group in GROUPS:
            cells = [(row, row["alarms"][detector][group]) for row in rows
                     if group in row["alarms"][detector]]
            if not cells:
                continue
            healthy = [row for row, _ in cells if row["healthy"]]
            faulty = [(row, step) for row, step in cells if not row["healthy"]]
            detected = [step for row, step in faulty
                        if step is not None and not _is_false(row, step)]
            diverged = [(row, step) for row, step in cells if row["divergence"] is not None]
            leads = [row["divergence"] - step for row, step in diverged
                     if step is not None and not _is_false(row, step)]
            summary[f"{detector}/{group}"] = {
                "false_alarm_runs": sum(1 for row, step in cells if _is_false(row, step)),
                "healthy_runs": len(healthy),
                "runs": len(cells),
                "fault_runs": len(faulty),
                "fault_runs_alarmed": len(detected),
                "median_alarm_step": statistics.median(detected) if detected else None,
                "diverged_runs": len(diverged),
                "alarmed_before_divergence": sum(1 for lead in leads if lead > 0),
                "median_lead": statistics.median(leads) if leads else None,
            }
    return summary


def _cell(row: dict, step: int | None) -> str:
    if step is None:
        return "-"
    if _is_false(row, step):
        return f"{step} (false)"
    if row["divergence"] is not None:
        return f"{step} ({row['divergence'] - step:+d})"
    return str(step)


def write_markdown(result: dict, out: Path) -> str:
    groups = [g for g in GROUPS if any(g in r["alarms"]["trend"] for r in result["rows"])]
    lines = [f"# Alarm detectors on {result['scenario']}", "",
             "First alarm step per run, signal group and detector ("
             + " / ".join(COMPARED) + "); in brackets the lead over divergence (+: alarm first), or `false` for an "
             f"alarm in a healthy (`{result['healthy']}`) run or before a mid-run fault.", "",
             "| run | fault from | divergence | " + " | ".join(groups) + " |",
             "|---|---|---|" + "---|" * len(groups)]
    for row in result["rows"]:
        cells = [" / ".join(_cell(row, row["alarms"][d][g]) for d in COMPARED) for g in groups]
        start = "-" if row["fault_start"] is None else str(row["fault_start"])
        divergence = "-" if row["divergence"] is None else str(row["divergence"])
        lines.append(f"| {row['variant']} s{row['seed']} | {start} | {divergence} | "
                     + " | ".join(cells) + " |")
    lines += ["", "| detector | signal | false alarms (runs) | fault runs alarmed (median "
              "step) | diverged runs alarmed first | median lead (steps) |",
              "|---|---|---|---|---|---|"]
    for key, s in result["summary"].items():
        detector, group = key.split("/", 1)
        lead = "-" if s["median_lead"] is None else f"{s['median_lead']:.0f}"
        step = "" if s["median_alarm_step"] is None else f" ({s['median_alarm_step']:.0f})"
        lines.append(f"| {detector} | {group} | {s['false_alarm_runs']} of {s['runs']} "
                     f"| {s['fault_runs_alarmed']} of {s['fault_runs']}{step} "
                     f"| {s['alarmed_before_divergence']} of {s['diverged_runs']} | {lead} |")
    text = "\n".join(lines) + "\n"
    (out / "alarms.md").write_text(text)
    (out / "alarms.json").write_text(json.dumps(result, indent=2))
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="a fault scenario already run with `reproduce`")
    parser.add_argument("--smoke", action="store_true", help="the runs of `reproduce --smoke`")
    parser.add_argument("--out", default=None, help="its results directory "
                        "(default: results/SCENARIO[-smoke])")


def run(args: argparse.Namespace) -> dict:
    scenario = load_scenario(args.scenario)
    out = results_dir(scenario, args.out, args.smoke)
    result = compare(scenario, out, args.smoke)
    print(write_markdown(result, out))
    return result
