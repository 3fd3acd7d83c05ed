"""Per-variant figures of a scenario, over seeds: mean and spread, as JSON and markdown."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from megatron_gnmr.experiments.scenario import Scenario
from megatron_gnmr.jsonl import read_jsonl
from megatron_gnmr.training.divergence import DivergenceRule


COLLAPSED_EFFECTIVE_RANK = 2.0


def divergence_step(records: list[dict]) -> int | None:
    """The first logged step at which the run had diverged (`training/divergence.py`)."""
    rule = DivergenceRule()
    return next((r["step"] for r in records if "train/loss" in r
                 and rule.observe(r["step"], r["train/loss"])), None)


def first_step(records: list[dict], predicate) -> int | None:
    return next((r["step"] for r in records if predicate(r)), None)


def _collapsed(record: dict) -> bool:
    """The dW_q update of some layer has collapsed to (effectively) rank < 2."""
    ranks = [v for k, v in record.items() if k.startswith("monitor/attention/")
             and k.endswith("/effective_rank_dWq")]
    return bool(ranks) and min(ranks) < COLLAPSED_EFFECTIVE_RANK


def run_figures(run_dir: Path) -> dict:
    """What one run contributes to a table (all from its logs)."""
    path = run_dir / "summary.json"  # absent when the run stopped itself (exit 3)
    summary = json.loads(path.read_text()) if path.is_file() else {}
    records = read_jsonl(run_dir / "metrics.jsonl")
    train = [r["train/loss"] for r in records if "train/loss" in r]
    tail = train[-max(1, len(train) // 10):]  # the last tenth: identical batches across runs
    step_times = sorted(r["train/step_time_s"] for r in records if "train/step_time_s" in r)
    return {
        "final_valid_loss": summary.get("final_valid_loss"),
        "final_valid_ppl": math.exp(min(summary["final_valid_loss"], 50.0))
        if summary.get("final_valid_loss") is not None else None,
        "train_loss_last_tenth": statistics.mean(tail) if tail else None,
        "step_time_s": step_times[len(step_times) // 2] if step_times else None,
        "recovery_sparsity": summary.get("gnmr/recovery_sparsity"),
        "exceedance_rate": summary.get("gnmr/exceedance_rate"),
        "alarms": sum(1 for r in records if r.get("event") == "alarm"),
        "first_alarm_step": first_step(records, lambda r: r.get("event") == "alarm"),
        "first_attention_alarm": first_step(
            records, lambda r: r.get("event") == "alarm" and r.get("monitor") == "attention"),
        "first_router_alarm": first_step(
            records, lambda r: r.get("event") == "alarm" and r.get("monitor") == "router"),
        "dw_collapse_step": first_step(records, _collapsed),
        "divergence_step": divergence_step(records),
        "steps": summary.get("steps"),
        **downstream_figures(run_dir),
    }


DOWNSTREAM = {  # evaluation.json key -> table figure (`megatron-gnmr evaluate`)
    "loss": "heldout_loss", "ppl": "heldout_ppl", "cloze_accuracy": "cloze_accuracy",
    "retention/loss_increase": "retention_loss_increase", "base/ppl": "base_heldout_ppl",
    "base/cloze_accuracy": "base_cloze_accuracy"}


def downstream_figures(run_dir: Path) -> dict:
    """The evaluation's scores (deployed precision), and the held-out loss and cloze accuracy
    with every unit exact (`evaluate --exact`), when they were measured."""
    scores, exact = ({}, {})
    for name, target in (("evaluation.json", scores), ("evaluation-exact.json", exact)):
        if (run_dir / name).is_file():
            target.update(json.loads((run_dir / name).read_text()))
    return {**{figure: scores.get(key) for key, figure in DOWNSTREAM.items()},
            "exact_heldout_loss": exact.get("loss"),
            "exact_cloze_accuracy": exact.get("cloze_accuracy")}


def _mean_spread(values: list) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": statistics.mean(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0, "n": len(values)}


def summarize(scenario: Scenario, out: Path, smoke: bool) -> dict:
    seeds = scenario.smoke_seeds if smoke else scenario.seeds
    per_run = {variant: {seed: run_figures(out / f"{variant}-seed{seed}") for seed in seeds}
               for variant in scenario.variants}
    table = {}
    for variant, runs in per_run.items():
        keys = next(iter(runs.values())).keys()
        table[variant] = {key: _mean_spread([r[key] for r in runs.values()]) for key in keys}
    baseline = next(iter(per_run))  # the first variant: paired differences by seed
    for variant, runs in per_run.items():
        for figure, gap in (("train_loss_last_tenth", "train_loss_gap"),
                            ("heldout_loss", "heldout_loss_gap"),
                            ("cloze_accuracy", "cloze_accuracy_gap"),
                            ("exact_heldout_loss", "exact_heldout_loss_gap"),
                            ("exact_cloze_accuracy", "exact_cloze_accuracy_gap")):
            table[variant][gap] = _mean_spread(
                [r[figure] - per_run[baseline][seed][figure] for seed, r in runs.items()
                 if r[figure] is not None and per_run[baseline][seed][figure] is not None])
    reference = table[scenario.reference]["step_time_s"]["mean"]
    for variant in table:
        own = table[variant]["step_time_s"]["mean"]
        table[variant]["step_time_ratio"] = own / reference if own and reference else None
    return {"scenario": scenario.name, "description": scenario.description, "smoke": smoke,
            "seeds": seeds, "reference": scenario.reference, "baseline": baseline,
            "table": table, "runs": per_run}


def _cell(figure: dict, digits: int = 4, percent: bool = False) -> str:
    if figure["mean"] is None:
        return "-"
    if percent:
        return f"{100 * figure['mean']:.3f}%"
    spread = f" +- {figure['std']:.{digits}f}" if figure["n"] > 1 else ""
    return f"{figure['mean']:.{digits}f}{spread}"


def _steps(results: dict, variant: str, key: str) -> str:
    """Per-seed steps (an event's step is not averaged: '-' where it never happened)."""
    values = [run[key] for run in results["runs"][variant].values()]
    return "/".join("-" if v is None else str(v) for v in values)


def write_tables(results: dict, out: Path) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=2))
    lines = [f"# {results['scenario']}{' (smoke)' if results['smoke'] else ''}", "",
             results["description"].strip(), "",
             f"seeds {results['seeds']}; mean +- std over seeds; gap: training loss over the "
             f"last tenth of the steps minus `{results['baseline']}`'s on the same batches "
             f"(paired by seed); step-time ratio to `{results['reference']}`", "",
             "| variant | valid loss | valid ppl | train loss (last 10%) | gap | recovery sparsity "
             "| exceedance rate | step-time ratio | attention alarm | router alarm "
             "| dW collapse | divergence |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for variant, row in results["table"].items():
        ratio = row["step_time_ratio"]
        lines.append(
            f"| {variant} | {_cell(row['final_valid_loss'])} | {_cell(row['final_valid_ppl'], 1)}"
            f" | {_cell(row['train_loss_last_tenth'])} | {_cell(row['train_loss_gap'])}"
            f" | {_cell(row['recovery_sparsity'], percent=True)}"
            f" | {_cell(row['exceedance_rate'], percent=True)} | {f'{ratio:.2f}' if ratio else '-'}"
            f" | {_steps(results, variant, 'first_attention_alarm')}"
            f" | {_steps(results, variant, 'first_router_alarm')}"
            f" | {_steps(results, variant, 'dw_collapse_step')}"
            f" | {_steps(results, variant, 'divergence_step')} |")
    lines += _downstream_table(results)
    (out / "results.md").write_text("\n".join(lines) + "\n")


def _downstream_table(results: dict) -> list[str]:
    """The evaluation's scores (`megatron-gnmr evaluate`), when the scenario ran it."""
    rows = results["table"]
    if all(row["heldout_ppl"]["mean"] is None for row in rows.values()):
        return []
    lines = ["", "Downstream (`megatron-gnmr evaluate`, mean +- std over seeds): held-out "
             "perplexity and 4-way cloze accuracy on the run's validation split, their gaps to "
             f"`{results['baseline']}` (held-out loss, accuracy; paired by seed), the same "
             "with the adapters off (the base), and the retention loss increase on the base's "
             "corpus.", "",
             "| variant | held-out ppl | held-out loss gap | cloze acc | cloze gap | base ppl "
             "| base cloze acc | retention (loss increase) |", "|---|---|---|---|---|---|---|---|"]
    for variant, row in rows.items():
        lines.append(f"| {variant} | {_cell(row['heldout_ppl'], 2)} | "
                     f"{_cell(row['heldout_loss_gap'], 4)} | {_cell(row['cloze_accuracy'], 3)} | "
                     f"{_cell(row['cloze_accuracy_gap'], 3)} | "
                     f"{_cell(row['base_heldout_ppl'], 2)} | "
                     f"{_cell(row['base_cloze_accuracy'], 3)} | "
                     f"{_cell(row['retention_loss_increase'], 4)} |")
    if any(row["exact_heldout_loss"]["mean"] is not None for row in rows.values()):
        lines += ["", "The same runs evaluated with every unit exact (`evaluate --exact`: the "
                  "adapters on the unquantized base, as a model merged into its BF16 base is "
                  "served), gaps paired by seed:", "",
                  "| variant | held-out loss | held-out loss gap | cloze acc | cloze gap |",
                  "|---|---|---|---|---|"]
        lines += [f"| {variant} | {_cell(row['exact_heldout_loss'], 4)} | "
                  f"{_cell(row['exact_heldout_loss_gap'], 4)} | "
                  f"{_cell(row['exact_cloze_accuracy'], 3)} | "
                  f"{_cell(row['exact_cloze_accuracy_gap'], 3)} |" for variant, row in rows.items()]
    return lines
