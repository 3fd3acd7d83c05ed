"""One closed-loop run, summarised so that a third party can check it from the repository:
its loss every 25 steps, each alarm (step, layer, signal, detector, value), each recovery
(per unit, the steps it ran exact, as intervals), its budget over the steps it ran, the
command line, the commit, the package versions and the CPU model (`provenance.jsonl`, written
by `reproduce` when the run started)."""

from __future__ import annotations

import statistics
from pathlib import Path

from megatron_gnmr.experiments.tables import divergence_step
from megatron_gnmr.jsonl import read_jsonl

LOSS_EVERY = 25
TAIL_STEPS = 300  # the final loss: mean training loss over the last 300 steps


def _intervals(steps: list[int]) -> list[list[int]]:
    """Sorted steps -> [[first, last], ...] of consecutive runs."""
    out: list[list[int]] = []
    for step in steps:
        if out and step == out[-1][1] + 1:
            out[-1][1] = step
        else:
            out.append([step, step])
    return out


def _provenance(run_dir: Path) -> dict:
    path = run_dir / "provenance.jsonl"
    starts = read_jsonl(path) if path.is_file() else []
    if not starts:
        return {}
    first = starts[0]
    return {"command": first.get("command"), "commits": sorted({s.get("commit") for s in starts
                                                                if s.get("commit")}),
            "packages": first.get("packages"), "cpu": first.get("cpu"),
            "launches": len(starts)}


def run_summary(run_dir: Path) -> dict:
    """What one run contributes (from metrics.jsonl, gnmr_trace.jsonl, provenance.jsonl)."""
    records = read_jsonl(run_dir / "metrics.jsonl")
    losses = {r["step"]: r["train/loss"] for r in records if "train/loss" in r}
    steps = max(losses, default=0)
    trace_path = run_dir / "gnmr_trace.jsonl"
    trace = read_jsonl(trace_path) if trace_path.is_file() else []
    header = next((r for r in trace if r.get("type") == "header"), {})
    units = header.get("units", [])
    decisions = [r for r in trace if r.get("type") != "header"]
    # a decision of step s is the recovery set of step s + 1
    ran_exact = {unit: [] for unit in units}
    for record in decisions:
        if record["step"] + 1 <= steps:
            for index in record["recovery"]:
                ran_exact[units[index]].append(record["step"] + 1)
    recovered_unit_steps = sum(len(v) for v in ran_exact.values())
    shares = [r["precision/recovered_flop_share"] for r in records
              if "precision/recovered_flop_share" in r]
    tail = [losses[s] for s in sorted(losses)[-TAIL_STEPS:]]
    valid = [r["valid/loss"] for r in records if "valid/loss" in r]
    alarms = [{"step": r["step"], "layer": r.get("layer"), "signal": r.get("signal"),
               "detector": r.get("detector"), "value": r.get("value")}
              for r in records if r.get("event") == "alarm"]
    return {
        "run": run_dir.name,
        "finished": (run_dir / "summary.json").is_file(),
        "steps": steps,
        "diverged_at": divergence_step(records),
        "first_attention_alarm": next((a["step"] for a in alarms), None),
        "alarms": alarms,
        "recoveries": {unit: _intervals(s) for unit, s in ran_exact.items() if s},
        "first_recovery": min((s[0][0] for s in (_intervals(v) for v in ran_exact.values())
                               if s), default=None),
        "units": units,
        # every unit here is a core attention of the same cost: a share of the unit-steps
        # that ran is also the share of the attention FLOPs that ran
        "recovered_share_of_executed_steps":
            recovered_unit_steps / (steps * len(units)) if steps and units else 0.0,
        # the share of the units' GEMM FLOPs (linears and core attentions) run exact, as the
        # run logged it
        "recovered_gemm_flop_share": statistics.fmean(shares) if shares else None,
        "final_train_loss": statistics.fmean(tail) if tail else None,
        "final_valid_loss": valid[-1] if valid else None,
        "loss_every_25_steps": {str(s): losses[s] for s in sorted(losses)
                                if s % LOSS_EVERY == 0 or s == steps},
        **_provenance(run_dir),
    }
