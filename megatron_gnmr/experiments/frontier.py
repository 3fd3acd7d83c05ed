"""`megatron-gnmr compare-frontier SCENARIO`: which units to keep in high precision, as a
budget-quality frontier on a FLOP axis.

For a frontier scenario (`configs/scenarios/frontier_*.yaml`: an all-low and an all-high
variant and rules between them, each named in its `frontier:` section with its family):

- per run, a compact summary (the training loss over the last tenth of the steps, the final
  validation loss, the mean share of the units' GEMM FLOPs on the recovery path, the units it
  kept or recovered most, the CPU), written beside the run and gathered under `--summaries`
  (committed: the tables and the plot are rebuilt from the repository alone); the all-low
  runs, which trace the oracle's true weight-gradient error, also carry the run-time rules
  replayed on them at FLOP budgets (oracle capture: the share of the largest possible
  caught error);
- the calibration run (`calibration-seed101`, which `calibrate` ranks), when present: each
  measured quantity's per-unit mean and standard error over its traced steps
  (`calibration-seed101.json`, committed: the numbers the calibrated files were chosen by);
- the gate: all-low minus all-high, paired by seed, in standard errors;
- per rule: its FLOP share and the gap it recovers, (L_low - L) / (L_low - L_high) per seed,
  with a 90% bootstrap interval over seeds; the paired difference to the best production rule
  at no more FLOPs; and the frontier plot.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter
from pathlib import Path

import numpy as np
import yaml

from megatron_gnmr.errors import UserError
from megatron_gnmr.experiments.provenance import cpu_name
from megatron_gnmr.experiments.run_summaries import add_location_arguments, collect, locations
from megatron_gnmr.experiments.scenario import SCENARIO_DIR
from megatron_gnmr.jsonl import read_jsonl

BOOTSTRAP_DRAWS = 10_000
GATE_STANDARD_ERRORS = 4.0
REPLAYED = {  # run-time rules scored offline on the all-low traces
    "gnmr": {"signals": "gnmr"}, "qerr-peers": {"signals": "qerr", "qerr_baseline": "peers"},
    "qerr-history": {"signals": "qerr", "qerr_baseline": "history"},
    "random": {"signals": "random"}, "oracle": {"signals": "oracle"}}
REPLAY_BUDGETS = (0.125, 0.25)


def _top(counter: Counter, steps: int, count: int = 6) -> list[list]:
    return [[unit, round(n / max(steps, 1), 3)] for unit, n in counter.most_common(count)]


def run_summary(run_dir: Path) -> dict:
    records = read_jsonl(run_dir / "metrics.jsonl")
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    tail = losses[-max(1, len(losses) // 10):]
    valid = [r["valid/loss"] for r in records if "valid/loss" in r]
    shares = [r["precision/recovered_flop_share"] for r in records
              if "precision/recovered_flop_share" in r]
    config = json.loads((run_dir / "config.json").read_text())
    start = next((r for r in records if r.get("event") == "start"), {})
    chosen: Counter = Counter({unit: len(losses) for unit in start.get("kept_in_bf16", [])})
    trace_path = run_dir / "gnmr_trace.jsonl"
    summary = {"run": run_dir.name, "steps": len(losses),
               "train_loss_last_tenth": statistics.fmean(tail) if tail else None,
               "final_valid_loss": valid[-1] if valid else None,
               "flop_share": statistics.fmean(shares) if shares else _static_share(config),
               "recovery_gemms": config["precision"].get("precision_recovery_gemms",
                                                         "fprop,dgrad,wgrad"),
               "cpu": cpu_name()}
    if trace_path.is_file():
        from megatron_gnmr.controller.trace import read_trace

        trace = read_trace(str(trace_path))
        for decided in trace.recovery[:-1]:
            chosen.update(trace.units[u] for u in decided)
        if "oracle" in trace.measured and not any(trace.recovery):
            summary["replayed"] = replayed_rules(trace, run_dir)
    summary["most_recovered"] = _top(chosen, len(losses))
    return summary


def calibration_summary(run_dir: Path) -> dict:
    """Per measured quantity, each unit's mean and standard error over the traced steps."""
    from megatron_gnmr.controller.trace import read_trace

    trace = read_trace(str(run_dir / "gnmr_trace.jsonl"))
    valid = [r["valid/loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if "valid/loss" in r]
    measured = {}
    for name, values in trace.measured.items():
        steps = np.isfinite(values).sum(axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.nanmean(values, axis=0)
            error = np.nanstd(values, axis=0, ddof=1) / np.sqrt(steps)
        measured[name] = {unit: {"mean": float(m), "standard_error": float(e)}
                          for unit, m, e in zip(trace.units, mean, error)}
    return {"run": run_dir.name, "steps": len(trace.steps),
            "final_valid_loss": valid[-1] if valid else None, "cpu": cpu_name(),
            "measured": measured}


CALIBRATION_RUN = "calibration-seed101"  # scripts/reproduce/frontier.sh's


def _static_share(config: dict) -> float | None:
    """Runs made before the per-step share was logged: all-low and all-high only."""
    static = config["precision"]["precision_static"] == "recovery"
    if config["gnmr"]["enabled"] and config["gnmr"].get("max_o") != 0:
        return None
    if config["precision"].get("precision_config_file") or \
            config["precision"].get("first_last_layers_bf16"):
        return None
    return 1.0 if static else 0.0


def replayed_rules(trace, run_dir: Path) -> dict:
    """Each run-time rule replayed on an all-low trace at FLOP budgets: oracle capture and
    the FLOP share it would spend (max_o 8, lock 5, warm-up 16)."""
    from megatron_gnmr.calibrate import flop_shares
    from megatron_gnmr.controller.config import GNMRConfig
    from megatron_gnmr.controller.replay import replay

    if trace.unit_costs is None:  # traced before the costs were recorded: from the config
        shares = flop_shares(run_dir, trace.units, "fprop,dgrad,wgrad")
        trace.unit_costs = np.array([shares[u] * len(trace.units) for u in trace.units])
    out = {}
    for budget in REPLAY_BUDGETS:
        for name, rule in REPLAYED.items():
            config = GNMRConfig(**{**trace.config, "budget_rate": budget, "budget_in": "flops",
                                   "max_o": 8})
            result = replay(trace, config, signal_settings=rule)
            out[f"{name}@{budget}"] = {
                "oracle_capture": result.oracle_capture,
                "flop_share": result.summary["recovery_cost_share"],
                "most_recovered": [[u, n] for u, n in result.most_recovered[:4]]}
    return out


def bootstrap_interval(values: list[float], seed: int = 0) -> tuple[float, float]:
    """The 90% percentile interval of the mean over seeds, resampled with replacement."""
    data = np.asarray(values, dtype=np.float64)
    draws = np.random.default_rng(seed).integers(0, data.size, (BOOTSTRAP_DRAWS, data.size))
    means = data[draws].mean(axis=1)
    return float(np.percentile(means, 5)), float(np.percentile(means, 95))


def frontier_spec(scenario_name: str) -> dict:
    data = yaml.safe_load((SCENARIO_DIR / f"{scenario_name}.yaml").read_text())
    spec = data.get("frontier")
    if not spec:
        raise UserError(f"compare-frontier: {scenario_name} has no `frontier:` section")
    return spec


def gate(table: dict, low: str, high: str) -> dict:
    seeds = sorted(set(table.get(low, {})) & set(table.get(high, {})))
    gaps = [table[low][s]["train_loss_last_tenth"] - table[high][s]["train_loss_last_tenth"]
            for s in seeds]
    if len(gaps) < 2:
        return {"seeds": seeds, "gaps": gaps, "passed": False}
    mean, std = statistics.fmean(gaps), statistics.stdev(gaps)
    error = std / len(gaps) ** 0.5
    return {"seeds": seeds, "gaps": gaps, "mean": mean, "std": std, "standard_error": error,
            "in_standard_errors": mean / error if error else float("inf"),
            "passed": mean >= GATE_STANDARD_ERRORS * error}


def rule_rows(table: dict, spec: dict) -> list[dict]:
    low, high = spec["low"], spec["high"]
    rows = []
    for variant, runs in table.items():
        seeds = sorted(s for s in runs if s in table.get(low, {}) and s in table.get(high, {}))
        recovered = {}
        for s in seeds:
            lo = table[low][s]["train_loss_last_tenth"]
            gap = lo - table[high][s]["train_loss_last_tenth"]
            recovered[s] = (lo - runs[s]["train_loss_last_tenth"]) / gap if gap else None
        values = [v for v in recovered.values() if v is not None]
        shares = [r["flop_share"] for r in runs.values() if r["flop_share"] is not None]
        chosen: Counter = Counter()
        for run in runs.values():
            chosen.update({unit: share for unit, share in run["most_recovered"]})
        rows.append({
            "rule": variant, "family": _family(spec, variant), "seeds": seeds,
            "flop_share": statistics.fmean(shares) if shares else None,
            "recovery_gemms": next(iter(runs.values()))["recovery_gemms"],
            "recovered": recovered,
            "recovered_mean": statistics.fmean(values) if values else None,
            "recovered_interval": bootstrap_interval(values) if len(values) > 1 else None,
            "chosen_most": [u for u, _ in chosen.most_common(4)],
        })
    return sorted(rows, key=lambda r: (r["flop_share"] is None, r["flop_share"] or 0.0))


def _family(spec: dict, variant: str) -> str:
    for family in ("production", "ours", "run-time", "baseline"):
        if variant in spec.get(family, []):
            return family
    return "bound" if variant in (spec["low"], spec["high"]) else "other"


def against_best_production(rows: list[dict], budgets: list[float]) -> list[dict]:
    """At each budget: the best production rule within it (by mean gap recovered), and every
    other rule within it, paired by seed: (its gap recovered) - (the production rule's)."""
    out = []
    for budget in budgets:
        within = [r for r in rows if r["flop_share"] is not None and r["recovered_mean"]
                  is not None and r["flop_share"] <= budget + 0.005]
        production = [r for r in within if r["family"] == "production"]
        if not production:
            continue
        best = max(production, key=lambda r: r["recovered_mean"])
        for row in within:
            if row is best or row["family"] not in ("ours", "run-time"):
                continue
            seeds = [s for s in row["recovered"] if s in best["recovered"]
                     and row["recovered"][s] is not None and best["recovered"][s] is not None]
            diffs = [row["recovered"][s] - best["recovered"][s] for s in seeds]
            if len(diffs) < 2:
                continue
            out.append({"budget": budget, "rule": row["rule"], "best_production": best["rule"],
                        "difference": statistics.fmean(diffs),
                        "interval": bootstrap_interval(diffs), "seeds": len(diffs)})
    return out


def markdown(name: str, table: dict, spec: dict, rows: list[dict], verdicts: list[dict],
             gate_result: dict) -> str:
    g = gate_result
    lines = [f"# Frontier: {name}", ""]
    if "mean" in g:
        lines += [f"Gate: all-low minus all-high, training loss over the last tenth, paired by "
                  f"seed ({', '.join(f'{v:+.4f}' for v in g['gaps'])}): {g['mean']:+.4f} +- "
                  f"{g['std']:.4f}, standard error {g['standard_error']:.4f}, "
                  f"{g['in_standard_errors']:.1f} standard errors "
                  f"({'passed' if g['passed'] else 'NOT passed'}: >= "
                  f"{GATE_STANDARD_ERRORS:.0f} needed).", ""]
    lines += ["| rule | family | GEMM FLOPs on the recovery path | recovery GEMMs | gap recovered "
              "(mean, 90% bootstrap) | per seed | kept or recovered most |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        interval = r["recovered_interval"]
        gap = "-" if r["recovered_mean"] is None else f"{r['recovered_mean']:+.2f}" + (
            f" [{interval[0]:+.2f}, {interval[1]:+.2f}]" if interval else "")
        share = "-" if r["flop_share"] is None else f"{100 * r['flop_share']:.1f}%"
        seeds = " / ".join("-" if v is None else f"{v:+.2f}" for v in r["recovered"].values())
        chosen = ", ".join(u.replace("layers.", "L").replace("self_attention.", "")
                           .replace("mlp.", "") for u in r["chosen_most"])
        lines.append(f"| {r['rule']} | {r['family']} | {share} | {r['recovery_gemms']} | {gap} "
                     f"| {seeds} | {chosen} |")
    if verdicts:
        lines += ["", "Paired by seed against the best production rule within the same FLOP "
                  "budget (difference in gap recovered; 90% bootstrap interval over seeds):", "",
                  "| budget | rule | best production rule | difference | 90% interval |",
                  "|---|---|---|---|---|"]
        for v in verdicts:
            lines.append(f"| {100 * v['budget']:.1f}% | {v['rule']} | {v['best_production']} | "
                         f"{v['difference']:+.2f} | [{v['interval'][0]:+.2f}, "
                         f"{v['interval'][1]:+.2f}] |")
    replays = [run["replayed"] for run in table.get(spec["low"], {}).values()
               if "replayed" in run]
    if replays:
        lines += ["", f"Run-time rules replayed offline on the {len(replays)} all-low traces "
                  "(oracle capture: the true weight-gradient error of the units chosen, over "
                  "the most the same unit-steps could catch):", "",
                  "| rule @ FLOP budget | oracle capture | FLOP share spent |", "|---|---|---|"]
        for key in replays[0]:
            captures = [r[key]["oracle_capture"] for r in replays
                        if r[key]["oracle_capture"] is not None]
            shares = [r[key]["flop_share"] for r in replays]
            lines.append(f"| {key} | {statistics.fmean(captures):.2f} | "
                         f"{100 * statistics.fmean(shares):.1f}% |" if captures else
                         f"| {key} | - | - |")
    cpus = sorted({run["cpu"] for runs in table.values() for run in runs.values()})
    lines += ["", f"Runs made on: {', '.join(cpus)} (paired by seed on one CPU)."]
    return "\n".join(lines) + "\n"


def plot(name: str, rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"production": "tab:blue", "ours": "tab:red", "run-time": "tab:green",
              "baseline": "tab:gray", "bound": "black", "other": "tab:purple"}
    figure, axes = plt.subplots(figsize=(8, 5.5))
    for r in rows:
        if r["flop_share"] is None or r["recovered_mean"] is None:
            continue
        x, y = 100 * r["flop_share"], r["recovered_mean"]
        low, high = r["recovered_interval"] or (y, y)
        axes.errorbar(x, y, yerr=[[y - low], [high - y]], fmt="o", capsize=3,
                      color=colors[r["family"]])
        axes.annotate(r["rule"], (x, y), textcoords="offset points", xytext=(5, 3), fontsize=7)
    for family, color in colors.items():
        if any(r["family"] == family for r in rows):
            axes.plot([], [], "o", color=color, label=family)
    axes.axhline(0.8, color="gray", linestyle=":", linewidth=1)
    axes.set_xlabel("units' GEMM FLOPs on the recovery path (%)")
    axes.set_ylabel("gap recovered (0 = all-low, 1 = all-high)")
    axes.set_title(f"{name}: gap recovered against FLOPs kept high (90% bootstrap)")
    axes.legend(loc="lower right", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="a frontier scenario (frontier_act_quant, ...)")
    add_location_arguments(parser)


def run(args: argparse.Namespace) -> list[dict]:
    scenario, runs, summaries = locations(args)
    spec = frontier_spec(scenario.name)
    table = collect(scenario, runs, summaries, run_summary)
    if spec["low"] not in table or spec["high"] not in table:
        raise UserError(f"compare-frontier {scenario.name}: no finished {spec['low']} and "
                        f"{spec['high']} runs in {runs} and no summaries in {summaries}")
    rows = rule_rows(table, spec)
    verdicts = against_best_production(rows, spec.get("budgets", [0.125, 0.25]))
    text = markdown(scenario.name, table, spec, rows, verdicts,
                    gate(table, spec["low"], spec["high"]))
    (summaries / "table.md").write_text(text)
    if (runs / CALIBRATION_RUN / "gnmr_trace.jsonl").is_file():
        (summaries / f"{CALIBRATION_RUN}.json").write_text(
            json.dumps(calibration_summary(runs / CALIBRATION_RUN), indent=1) + "\n")
    plot(scenario.name, rows, summaries / "frontier.png")
    print(text)
    return rows
