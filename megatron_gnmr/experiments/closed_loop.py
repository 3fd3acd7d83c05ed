"""`megatron-gnmr compare-closed-loop SCENARIO`: did the controller save the runs that die?

For a fault scenario whose runs stop once diverged (`attention_closed_loop`): per run, a
compact summary (divergence step, first alarm, first recovery, share of unit-steps and of
the units' FLOPs on the recovery path, final losses, the machine it ran on), gathered
under `--summaries DIR` (`run_summaries.py`; committed to the repository: the tables are
rebuilt from it without the run directories or checkpoints).
Then per variant: runs diverged / runs, alarm and recovery steps against the divergence step
of the uncontrolled run of the same seed, the recovered shares, and the final loss gap to the
exact-attention run of the same seed (runs that did not diverge).

Pairing by seed is only as good as the trajectories are equal: every controlled variant's
first recovery is compared with its budget-0 twin (`loop-no-budget`, the same code path and
trajectory until then) as well as with the uncontrolled run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

from megatron_gnmr.errors import UserError
from megatron_gnmr.experiments.run_summaries import add_location_arguments, collect, locations
from megatron_gnmr.experiments.tables import divergence_step, first_step
from megatron_gnmr.jsonl import read_jsonl

UNCONTROLLED, EXACT = "no-control", "exact-attention"
TWIN = "loop-no-budget"
TAIL_STEPS = 300  # the final loss: mean training loss over the last 300 steps


def cpu_name() -> str:
    """The CPU's model name (runs are bitwise reproducible on one CPU only)."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def run_summary(run_dir: Path) -> dict:
    """What one run contributes (from its metrics.jsonl and gnmr_trace.jsonl)."""
    records = read_jsonl(run_dir / "metrics.jsonl")
    losses = [(r["step"], r["train/loss"]) for r in records if "train/loss" in r]
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    trace_path = run_dir / "gnmr_trace.jsonl"
    trace = [r for r in read_jsonl(trace_path) if r.get("type") != "header"] \
        if trace_path.is_file() else []
    header = next((r for r in read_jsonl(trace_path) if r.get("type") == "header"), {}) \
        if trace_path.is_file() else {}
    units = header.get("units", [])
    recovered = sum(len(r["recovery"]) for r in trace)
    first_recovery = next((r["step"] + 1 for r in trace if r["recovery"]), None)
    valid = [r["valid/loss"] for r in records if "valid/loss" in r]
    tail = [loss for step, loss in losses[-TAIL_STEPS:]]
    return {
        "run": run_dir.name,
        "finished": bool(summary),
        "steps": losses[-1][0] if losses else 0,
        "diverged_at": divergence_step(records),
        "first_attention_alarm": first_step(
            records, lambda r: r.get("event") == "alarm" and r.get("monitor") == "attention"),
        "alarms": sum(1 for r in records if r.get("event") == "alarm"),
        "first_recovery": first_recovery,  # the step that first ran a unit's recovery path
        # every unit here is a core attention of the same cost: the unit-step share is also
        # the share of the units' FLOPs
        "recovered_unit_step_share": recovered / (len(trace) * len(units))
        if trace and units else 0.0,
        "final_train_loss": statistics.fmean(tail) if tail else None,
        "final_valid_loss": valid[-1] if valid else None,
        "cpu": cpu_name(),
    }


def _median(values) -> str:
    values = [v for v in values if v is not None]
    return f"{statistics.median(values):.0f}" if values else "-"


def _mean_std(values) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):+.3f} +- {spread:.3f} (n={len(values)})"


def variant_rows(table: dict[str, dict[int, dict]]) -> list[dict]:
    uncontrolled = table.get(UNCONTROLLED, {})
    exact = table.get(EXACT, {})
    twin = table.get(TWIN, {})
    rows = []
    for variant, runs in table.items():
        leads = [uncontrolled[seed]["diverged_at"] - run["first_recovery"]
                 for seed, run in runs.items() if run["first_recovery"] is not None
                 and uncontrolled.get(seed, {}).get("diverged_at") is not None]
        gaps = [run["final_train_loss"] - exact[seed]["final_train_loss"]
                for seed, run in runs.items() if run["diverged_at"] is None
                and run["steps"] == exact.get(seed, {}).get("steps")]
        shares = [r["recovered_unit_step_share"] for r in runs.values()]
        # every --gnmr variant runs its twin's code path, step for step, until its first
        # recovery: where the twin died, did this run live?
        twin_died = [seed for seed in runs if twin.get(seed, {}).get("diverged_at") is not None]
        saved = [seed for seed in twin_died if runs[seed]["diverged_at"] is None]
        rows.append({
            "variant": variant,
            "diverged": f"{sum(r['diverged_at'] is not None for r in runs.values())} / "
                        f"{len(runs)}",
            "divergence steps": " ".join(str(runs[s]["diverged_at"] or "-")
                                         for s in sorted(runs)),
            "first alarm (median)": _median(r["first_attention_alarm"] for r in runs.values()),
            "first recovery (median)": _median(r["first_recovery"] for r in runs.values()),
            "recovery before uncontrolled divergence": f"{sum(lead > 0 for lead in leads)} / "
                                                       f"{len(leads)} (median lead "
                                                       f"{_median(leads)})" if leads else "-",
            "saved where its no-budget twin diverged": f"{len(saved)} / {len(twin_died)}"
            if twin_died and variant not in (TWIN, UNCONTROLLED, EXACT) else "-",
            "unit-steps (= attention FLOPs) recovered":
                f"{100 * statistics.fmean(shares):.1f}%",
            "final loss gap to exact (runs that did not diverge)": _mean_std(gaps),
        })
    return rows


def markdown(rows: list[dict], table: dict) -> str:
    columns = list(rows[0]) if rows else []
    cpus = sorted({run["cpu"] for runs in table.values() for run in runs.values()})
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    lines += ["", f"Runs made on: {', '.join(cpus)} (pairs by seed are bitwise comparable only "
                  "on one CPU)."]
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="a scenario whose runs stop once diverged "
                        "(attention_closed_loop)")
    add_location_arguments(parser)


def run(args: argparse.Namespace) -> list[dict]:
    scenario, runs, summaries = locations(args)
    table = collect(scenario, runs, summaries, run_summary)
    if not table:
        raise UserError(f"compare-closed-loop {scenario.name}: no finished run in {runs} and "
                        f"no summary in {summaries}")
    rows = variant_rows(table)
    text = markdown(rows, table)
    (summaries / "table.md").write_text(text)
    print(text)
    return rows
