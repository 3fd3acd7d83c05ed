"""`megatron-gnmr compare-signals SCENARIO`: the equal-budget table of risk signals.

Reads the runs `megatron-gnmr reproduce SCENARIO` wrote (the risk_signals_* scenarios: a
fixed low path, a fixed high path, full precision, and controlled variants at one budget)
and reports per variant, over seeds:

- the share of the low path's loss gap it recovers, paired by seed on identical batches:
  (L_low - L_variant) / (L_low - L_high), L = training loss over the last tenth of the steps;
  the same on the final validation loss;
- unit-steps on the recovery path (recovery sparsity);
- oracle capture in the live run: the true weight-gradient error of the units it recovered,
  over the most the same unit-steps could have caught (from the traced oracle errors);
and a replay matrix: every rule replayed on every controlled run's trace at the scenario's
budget, scored by oracle capture (what each rule WOULD pick on the same trajectories).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from megatron_gnmr.controller.config import GNMRConfig
from megatron_gnmr.controller.replay import oracle_capture, replay
from megatron_gnmr.controller.trace import read_trace
from megatron_gnmr.errors import UserError
from megatron_gnmr.experiments.scenario import Scenario, load_scenario, results_dir
from megatron_gnmr.experiments.tables import run_figures

REPLAYED_RULES = ({"signals": "gnmr"}, {"signals": "qerr", "qerr_baseline": "history"},
                  {"signals": "qerr", "qerr_baseline": "peers"},
                  {"signals": "gnmr,qerr", "qerr_baseline": "peers"}, {"signals": "random"},
                  {"signals": "static"}, {"signals": "oracle"})


def _rule_name(rule: dict) -> str:
    baseline = rule.get("qerr_baseline")
    return rule["signals"] + (f" ({baseline})" if baseline else "")


def _mean_std(values: list[float]) -> tuple[float | None, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def compare(scenario: Scenario, out: Path, low: str, high: str, smoke: bool = False) -> dict:
    seeds = scenario.smoke_seeds if smoke else scenario.seeds
    for name in (low, high):
        if name not in scenario.variants:
            raise UserError(f"compare-signals: {scenario.name} has no variant {name!r}")
    figures = {}
    for variant in scenario.variants:
        for seed in seeds:
            run_dir = out / f"{variant}-seed{seed}"
            if not (run_dir / "metrics.jsonl").is_file():
                raise UserError(f"compare-signals: {run_dir} is missing; run `megatron-gnmr "
                                f"reproduce {scenario.name}` first")
            figures[(variant, seed)] = run_figures(run_dir)
    rows = {}
    for variant in scenario.variants:
        recovered, recovered_valid, sparsity, capture = [], [], [], []
        for seed in seeds:
            f, lo, hi = (figures[(v, seed)] for v in (variant, low, high))
            for key, bucket in (("train_loss_last_tenth", recovered),
                                ("final_valid_loss", recovered_valid)):
                gap = lo[key] - hi[key]
                bucket.append((lo[key] - f[key]) / gap if gap else None)
            sparsity.append(f["recovery_sparsity"])
            trace_path = out / f"{variant}-seed{seed}" / "gnmr_trace.jsonl"
            if trace_path.is_file():
                trace = read_trace(str(trace_path))
                capture.append(oracle_capture(trace, trace.recovery))
        rows[variant] = {"gap_recovered": _mean_std(recovered),
                         "valid_gap_recovered": _mean_std(recovered_valid),
                         "recovery_sparsity": _mean_std(sparsity),
                         "oracle_capture": _mean_std(capture),
                         "per_seed_recovered": recovered}
    low_minus_high = [figures[(low, seed)]["train_loss_last_tenth"]
                      - figures[(high, seed)]["train_loss_last_tenth"] for seed in seeds]
    return {"scenario": scenario.name, "seeds": seeds, "low": low, "high": high,
            "low_minus_high": low_minus_high, "rows": rows,
            "replay": replay_matrix(scenario, out, seeds)}


def separation_warning(result: dict) -> str | None:
    """A warning when the low-cost path is not measurably worse than the recovery path: the
    paired difference is not above twice its standard error. Then 'gap recovered' divides by
    noise, and more mantissa bits need not mean less damage (docs/results.md section 8)."""
    diffs = result["low_minus_high"]
    mean, std = _mean_std(diffs)
    if mean is None:
        return None
    error = std / len(diffs) ** 0.5 if len(diffs) > 1 else abs(mean)
    if mean > 2 * error:
        return None
    return (f"**Warning:** `{result['low']}` is not measurably worse than `{result['high']}` "
            f"here (training loss {mean:+.4f} +- {std:.4f} over {len(diffs)} paired seeds): "
            "'gap recovered' divides by noise and ranks nothing. Rank by damage capture, or "
            "run longer, larger or with more seeds; at small scale a format with more "
            "mantissa bits can train worse (docs/results.md, section 8).")


def _base_budget(scenario: Scenario) -> float:
    flags = scenario.base
    return float(flags[flags.index("--gnmr-budget-rate") + 1]) \
        if "--gnmr-budget-rate" in flags else 0.0


def replay_matrix(scenario: Scenario, out: Path, seeds: list[int]) -> dict:
    """rule -> mean oracle capture and sparsity when replayed on every controlled trace, all
    at the scenario's base budget."""
    paths = [out / f"{variant}-seed{seed}" / "gnmr_trace.jsonl"
             for variant in scenario.variants for seed in seeds]
    traces = [read_trace(str(p)) for p in paths if p.is_file()]
    traces = [t for t in traces if "oracle" in t.measured and "qerr" in t.measured]
    budget = _base_budget(scenario)
    matrix = {}
    for rule in REPLAYED_RULES:
        captures, sparsities = [], []
        for trace in traces:
            config = GNMRConfig(**{**trace.config, "budget_rate": budget})
            result = replay(trace, config, signal_settings=rule)
            captures.append(result.oracle_capture)
            sparsities.append(result.summary["recovery_sparsity"])
        matrix[_rule_name(rule)] = {"oracle_capture": _mean_std(captures),
                                    "recovery_sparsity": _mean_std(sparsities),
                                    "traces": len(traces)}
    return matrix


def _cell(pair, percent: bool = False) -> str:
    mean, std = pair
    if mean is None:
        return "-"
    if percent:
        return f"{100 * mean:.1f}% +- {100 * std:.1f}"
    return f"{mean:.2f} +- {std:.2f}"


def write_markdown(result: dict, out: Path) -> str:
    lines = [f"# Equal-budget risk signals: {result['scenario']}", "",
             f"seeds {result['seeds']}; gap recovered = (L_{result['low']} - L) / "
             f"(L_{result['low']} - L_{result['high']}), paired by seed (1 = as good as "
             f"{result['high']}, 0 = no better than {result['low']}, < 0 worse)", "",
             "| variant | train-loss gap recovered | valid-loss gap recovered | per seed (train) "
             "| unit-steps on recovery | oracle capture (live) |", "|---|---|---|---|---|---|"]
    warning = separation_warning(result)
    if warning:
        lines[2:2] = [warning, ""]
    for variant, row in result["rows"].items():
        seeds = " / ".join("-" if v is None else f"{v:.2f}" for v in row["per_seed_recovered"])
        lines.append(f"| {variant} | {_cell(row['gap_recovered'])} "
                     f"| {_cell(row['valid_gap_recovered'])} | {seeds} "
                     f"| {_cell(row['recovery_sparsity'], True)} "
                     f"| {_cell(row['oracle_capture'], True)} |")
    traces = next(iter(result["replay"].values()), {}).get("traces", 0)
    lines += ["", f"Replayed on all {traces} controlled traces at the scenario's budget "
              "(oracle capture: share of the largest possible true weight-gradient error the "
              "rule's recovery set catches):", "",
              "| rule | oracle capture | unit-steps on recovery |", "|---|---|---|"]
    for rule, row in result["replay"].items():
        lines.append(f"| {rule} | {_cell(row['oracle_capture'], True)} "
                     f"| {_cell(row['recovery_sparsity'], True)} |")
    text = "\n".join(lines) + "\n"
    (out / "signals.md").write_text(text)
    (out / "signals.json").write_text(json.dumps(result, indent=2))
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="an equal-budget scenario already run with `reproduce`")
    parser.add_argument("--low", default=None, help="the fixed low-cost variant "
                        "(default: the scenario's reference variant)")
    parser.add_argument("--high", default=None, help="the fixed recovery-path variant "
                        "(default: the variant named fixed-8bit or fixed-fp8)")
    parser.add_argument("--smoke", action="store_true", help="the runs of `reproduce --smoke`")
    parser.add_argument("--out", default=None, help="its results directory "
                        "(default: results/SCENARIO[-smoke])")


def run(args: argparse.Namespace) -> dict:
    scenario = load_scenario(args.scenario)
    out = results_dir(scenario, args.out, args.smoke)
    high = args.high or next((v for v in ("fixed-8bit", "fixed-fp8") if v in scenario.variants),
                             None)
    if high is None:
        raise UserError("compare-signals: say which variant is the fixed high path (--high)")
    result = compare(scenario, out, args.low or scenario.reference, high, args.smoke)
    print(write_markdown(result, out))
    return result
