"""`megatron-gnmr report`: one PNG from the JSONL logs of one or more runs.

Panels: loss (train, smoothed, and validation) with the runs overlaid; the distribution of
GNMR scores over all unit-steps; per run, the recovery timeline (units x steps, dark where
the unit ran the recovery path, red ticks at non-finite gradients) with the share of
unit-steps recovered per kind of unit (attention, dense MLP, shared and routed experts);
monitor signals with alarm markers. GNMR scores are not stored in the trace: they are recomputed by replaying
the recorded norms through the policy with the recorded settings, which reproduces the live
run exactly. Reads runs in progress and crashed runs (a cut last line is ignored).
"""

from __future__ import annotations

import argparse
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_gnmr.errors import UserError
from megatron_gnmr.jsonl import read_jsonl


@dataclass
class RunLog:
    name: str
    records: list[dict]
    units: list[str]
    recovery: np.ndarray | None  # [steps, units] bool: on the recovery path during the step
    gnmr: np.ndarray | None  # [steps, units]
    alpha: float | None
    first_step: int = 1  # the step of row 0 (a window of a longer run starts later)
    evaluation: dict | None = None  # `megatron-gnmr evaluate`'s scores, if it ran


def _evaluation(root: Path) -> dict | None:
    path = root / "evaluation.json"
    return json.loads(path.read_text()) if path.is_file() else None


def evaluation_line(run: RunLog) -> str | None:
    """The downstream scores in one line (None if the run was not evaluated)."""
    scores = run.evaluation
    if not scores:
        return None
    parts = []
    if "ppl" in scores:
        parts.append(f"held-out ppl {scores['ppl']:.1f}")
    if "cloze_accuracy" in scores:
        parts.append(f"cloze {100 * scores['cloze_accuracy']:.1f}%")
    if "base/ppl" in scores:
        parts.append(f"(base {scores['base/ppl']:.1f}"
                     + (f", {100 * scores['base/cloze_accuracy']:.1f}%)"
                        if "base/cloze_accuracy" in scores else ")"))
    if "retention/loss_increase" in scores:
        parts.append(f"retention loss +{scores['retention/loss_increase']:.3f}")
    return f"{run.name}: " + ", ".join(parts)


def load_run(run_dir: str) -> RunLog:
    from megatron_gnmr.controller.config import GNMRConfig
    from megatron_gnmr.controller.policy import GNMRPolicy
    from megatron_gnmr.controller.trace import read_trace

    root = Path(run_dir)
    metrics = root / "metrics.jsonl"
    if not metrics.is_file():
        raise UserError(f"report: {run_dir} has no metrics.jsonl (is it a run directory?)")
    records = read_jsonl(metrics)
    trace_path = root / "gnmr_trace.jsonl"
    if not trace_path.is_file():
        return RunLog(root.name, records, [], None, None, None, evaluation=_evaluation(root))
    trace = read_trace(str(trace_path))
    known = {f for f in GNMRConfig.__dataclass_fields__}
    config = GNMRConfig(**{k: v for k, v in trace.config.items() if k in known})
    policy = GNMRPolicy(config, len(trace.units), trace.unit_costs)
    gnmr = np.array([policy.step(row).gnmr for row in trace.norms]).reshape(
        len(trace.steps), len(trace.units))
    recovery = np.zeros((len(trace.steps), len(trace.units)), dtype=bool)
    for row, decided in enumerate(trace.recovery[:-1]):  # decided at t, runs in step t + 1
        recovery[row + 1, list(decided)] = True
    return RunLog(root.name, records, trace.units, recovery, gnmr, config.alpha,
                  evaluation=_evaluation(root))


def _smooth(values: np.ndarray) -> np.ndarray:
    window = max(1, len(values) // 20)
    if window == 1:
        return values
    kernel = np.ones(window) / window
    return np.convolve(values, kernel, mode="valid")


def _loss_panel(ax, runs: list[RunLog]) -> None:
    for index, run in enumerate(runs):
        color = f"C{index}"
        train = [(r["step"], r["train/loss"]) for r in run.records if "train/loss" in r]
        valid = [(r["step"], r["valid/loss"]) for r in run.records if "valid/loss" in r]
        if train:
            steps, losses = map(np.array, zip(*train))
            smoothed = _smooth(losses)
            ax.plot(steps[len(steps) - len(smoothed):], smoothed, color=color,
                    label=f"{run.name} train")
        if valid:
            steps, losses = zip(*valid)
            ax.plot(steps, losses, "o--", color=color, markersize=4, label=f"{run.name} valid")
    ax.set_title("Loss")
    ax.set_xlabel("step")
    ax.legend(fontsize=7, loc="upper right")
    lines = [line for run in runs if (line := evaluation_line(run))]
    if lines:
        ax.text(0.01, 0.01, "\n".join(lines), transform=ax.transAxes, fontsize=7,
                va="bottom", bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "0.8"})


def _gnmr_panel(ax, runs: list[RunLog]) -> None:
    drawn = False
    for index, run in enumerate(runs):
        if run.gnmr is None:
            continue
        scores = run.gnmr[np.isfinite(run.gnmr) & (run.gnmr > 0)]
        if scores.size:
            ax.hist(np.log10(scores), bins=60, alpha=0.5, color=f"C{index}", label=run.name)
            ax.axvline(np.log10(run.alpha), color=f"C{index}", linestyle=":",
                       label=f"alpha {run.alpha:g}")
            drawn = True
    ax.set_title("GNMR score distribution (all unit-steps)")
    ax.set_xlabel("log10 GNMR")
    ax.set_yscale("log")
    if drawn:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "no GNMR trace in these runs", ha="center", transform=ax.transAxes)


MAX_ROWS = 64  # unit rows drawn per panel; above it, consecutive units share a row


def unit_rows(units: list[str], max_rows: int = MAX_ROWS) -> tuple[list[str], np.ndarray]:
    """Row labels and, per unit, its row: one row per unit up to `max_rows`, else contiguous
    groups of units in canonical (layer) order, so an image never grows with the model
    (31k units of a DeepSeek-V3-sized MoE would exceed the image backend's pixel limit)."""
    short = [u.replace("self_attention.", "").replace("mlp.", "") for u in units]
    if len(units) <= max_rows:
        return short, np.arange(len(units))
    row_of = np.arange(len(units)) * max_rows // len(units)
    labels = []
    for row in range(max_rows):
        members = np.flatnonzero(row_of == row)
        labels.append(f"{short[members[0]]} .. ({members.size} units)")
    return labels, row_of


def _by_row(values: np.ndarray, row_of: np.ndarray, rows: int, reduce) -> np.ndarray:
    """[steps, units] -> [steps, rows] with `reduce` (np.nanmean, np.nanmax) per row."""
    out = np.full((values.shape[0], rows), np.nan)
    for row in range(rows):
        members = values[:, row_of == row]
        if members.size:
            with warnings.catch_warnings():  # an all-NaN row (no score yet) stays NaN
                warnings.simplefilter("ignore", RuntimeWarning)
                out[:, row] = reduce(members, axis=1)
    return out


def _label_rows(ax, labels: list[str]) -> None:
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=max(3, 8 - len(labels) // 16))


def recovery_shares(run: RunLog) -> dict[str, tuple[int, int]]:
    """Per kind of unit (attention, dense MLP, shared expert, routed experts): (unit-steps on
    the recovery path, unit-steps), over the kinds the model has."""
    from megatron_gnmr.controller.units import UNIT_KINDS, unit_kind

    kinds = np.array([unit_kind(unit) for unit in run.units])
    shares = {}
    for kind in UNIT_KINDS:
        members = kinds == kind
        if members.any():
            shares[kind] = (int(run.recovery[:, members].sum()), int(run.recovery[:, members].size))
    return shares


def shares_line(run: RunLog) -> str:
    """`attention 2.1%, routed experts 0.8%` (share of each kind's unit-steps recovered)."""
    return ", ".join(f"{kind} {100 * on / max(total, 1):.1f}%"
                     for kind, (on, total) in recovery_shares(run).items())


def kept_line(run: RunLog) -> str | None:
    """The units the run's --precision-config-file kept in BF16 (from its start event)."""
    start = next((r for r in run.records if r.get("event") == "start"), {})
    kept = start.get("kept_in_bf16")
    if not kept:
        return None
    names = kept if isinstance(kept, list) else [f"{kept} units"]  # older runs: a count
    return f"kept in BF16 by the precision config: {', '.join(names)}"


def _timeline_panel(ax, run: RunLog) -> None:
    grouped = len(run.units) > MAX_ROWS
    kept = kept_line(run)
    ax.set_title(f"Recovery timeline: {run.name} (dark = recovery path; red line = monitor "
                 "alarm" + ("; a row is a group of units: the share recovered)" if grouped
                            else ")")
                 + (f"\nunit-steps recovered: {shares_line(run)}" if run.recovery is not None
                    else "") + (f"\n{kept}" if kept else ""), fontsize=9)
    if run.recovery is None:
        ax.text(0.5, 0.5, "no GNMR trace (controller off)", ha="center", transform=ax.transAxes)
        ax.axis("off")
        return
    labels, row_of = unit_rows(run.units)
    recovery = _by_row(run.recovery.astype(float), row_of, len(labels), np.mean)
    first = run.first_step - 0.5
    ax.imshow(recovery.T, aspect="auto", interpolation="nearest", cmap="Greys", vmin=0, vmax=1,
              extent=(first, first + recovery.shape[0], len(labels) - 0.5, -0.5))
    _label_rows(ax, labels)
    for alarm in (r for r in run.records if r.get("event") == "alarm"):
        ax.axvline(alarm["step"], color="red", linestyle=":", linewidth=1)
        ax.annotate(f"alarm {alarm.get('monitor', '')} L{alarm.get('layer', '')}",
                    (alarm["step"], -0.5), color="red", fontsize=7, rotation=90,
                    va="top", ha="right")
    nonfinite = [r for r in run.records if r.get("event") == "nonfinite_gradient"]
    for event in nonfinite:
        for unit in event.get("units", []):
            if unit in run.units:
                ax.plot(event["step"], row_of[run.units.index(unit)], "r|", markersize=10)
    ax.set_xlabel("step")


def _monitor_panel(ax, runs: list[RunLog]) -> None:
    ax.set_title("Monitor signals (x = alarm)")
    drawn = False
    for index, run in enumerate(runs):
        keys = sorted({k for r in run.records for k in r if k.startswith("monitor/")
                       and isinstance(r[k], (int, float))})
        for number, key in enumerate(keys[:6]):
            points = [(r["step"], r[key]) for r in run.records if key in r]
            steps, values = zip(*points)
            ax.plot(steps, values, label=f"{run.name} {key.removeprefix('monitor/')}",
                    color=f"C{number}", linestyle=("-", "--", ":", "-.")[index % 4], alpha=0.8)
            drawn = True
        for alarm in (r for r in run.records if r.get("event") == "alarm"):
            ax.axvline(alarm["step"], color=f"C{index}", linestyle="--")
            ax.plot(alarm["step"], alarm.get("value", 0), "x", color="red")
    if drawn:
        ax.legend(fontsize=6)
    else:
        ax.text(0.5, 0.5, "no monitor signals in these runs", ha="center",
                transform=ax.transAxes)
        ax.axis("off")


def render_report(runs: list[RunLog]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = 2 + len(runs)
    figure = plt.figure(figsize=(14, 3.6 * rows), constrained_layout=True)
    grid = figure.add_gridspec(rows, 2)
    _loss_panel(figure.add_subplot(grid[0, 0]), runs)
    _gnmr_panel(figure.add_subplot(grid[0, 1]), runs)
    for index, run in enumerate(runs):
        _timeline_panel(figure.add_subplot(grid[1 + index, :]), run)
    _monitor_panel(figure.add_subplot(grid[rows - 1, :]), runs)
    return figure


def _gnmr_heatmap_panel(ax, run: RunLog) -> None:
    ax.set_title(f"GNMR per unit: {run.name} (log10"
                 + ("; a row is a group of units: their maximum)" if len(run.units) > MAX_ROWS
                    else ")"))
    labels, row_of = unit_rows(run.units)
    scores = _by_row(np.log10(np.where(run.gnmr > 0, run.gnmr, np.nan)), row_of, len(labels),
                     np.nanmax)
    first = run.first_step - 0.5
    image = ax.imshow(scores.T, aspect="auto", interpolation="nearest", cmap="coolwarm",
                      vmin=-1, vmax=1, extent=(first, first + scores.shape[0],
                                               len(labels) - 0.5, -0.5))
    _label_rows(ax, labels)
    ax.figure.colorbar(image, ax=ax, fraction=0.02)


def timeline_figure(run: RunLog):
    """Per-unit GNMR heatmap and recovery timeline of one run (or of its recent window), for
    W&B / TensorBoard images during training."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    height = 0.25 * max(min(len(run.units), MAX_ROWS), 8) + 1
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(12, 2 * height),
                                         constrained_layout=True)
    _gnmr_heatmap_panel(top, run)
    _timeline_panel(bottom, run)
    return figure


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories")
    parser.add_argument("--out", default=None,
                        help="output PNG (default: report.png in the first run directory)")


def run(args: argparse.Namespace) -> Path:
    runs = [load_run(path) for path in args.runs]
    out = Path(args.out) if args.out else Path(args.runs[0]) / "report.png"
    figure = render_report(runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    for one in runs:
        if one.recovery is not None:
            print(f"{one.name}: unit-steps recovered: {shares_line(one)}")
        if (line := evaluation_line(one)) is not None:
            print(line)
        if (kept := kept_line(one)) is not None:
            print(f"{one.name}: {kept}")
    print(f"report: {out}")
    return out
