"""The fault ladder's table (markdown) and its picture: per rung, how lethal it is, and what
the kernel probe (and, for comparison, section 13's oracle) reads on faulted layers against
healthy ones, as distributions of the per-step values."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megatron_gnmr.experiments import detection_traces
from megatron_gnmr.experiments.detectors import LADDER_FAMILIES

SHOWN = (("kernel_output_bias", "O's error, sign agreement (probe)"),
         ("kernel_delta_bias", "delta's error, sign agreement (probe)"),
         ("kernel_delta_error", "delta's relative error (probe)"),
         ("rounding_bias", "O's rounding, sign agreement (oracle: reads the fault)"))


def _number(value, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _lethality_lines(result: dict) -> list[str]:
    margins = result["margins"]
    lines = [f"Harm margins: {margins['exact']:.4f} (twice exact attention's seed-to-seed SD "
             f"of the final loss) and {margins['healthy']:.4f} (twice the healthy FP8 runs'). "
             "A twin is lethal when it diverged or ended above exact attention of its seed by "
             "more than the margin.", "",
             "| rung | seeds | diverged | lethal (exact margin) | lethal (healthy margin) | "
             "died at (median step) | gap to exact of those that lived |",
             "|---|---|---|---|---|---|---|"]
    for rung, r in result["rungs"].items():
        died = [v["died_at"] for v in r["seeds"].values() if v["died_at"] is not None]
        gaps = [v["gap"] for v in r["seeds"].values() if v["gap"] is not None]
        lines.append(f"| {rung} | {r['judged']} | {r['died']} | {r['lethal_at_exact']} | "
                     f"{r['lethal_at_healthy']} | "
                     f"{_number(float(np.median(died)) if died else None)} | "
                     f"{', '.join(f'{g:+.3f}' for g in gaps) or '-'} |")
    lines += ["", "Rungs that kill (their twins died on at least half the seeds; harm without "
              "death does not count, a rule set after the training round, before any held-out "
              f"seed): **{', '.join(result['lethal_rungs']) or 'none'}**."]
    return lines


def _best_lines(result: dict) -> list[str]:
    """Per family, its best setting quiet on every healthy run, rung by rung."""
    rungs = list(result["rungs"])
    lines = ["Per detector family, its best setting by the held-out rule (fires on no "
             "healthy run; most dying twins of the lethal rungs named early and right): early "
             "and right / dying twins per rung, and its spend on the dying twins (attention "
             "FLOPs recovered + the probe's):", "",
             "| family | setting | " + " | ".join(rungs) + " |",
             "|---|---|" + "---|" * len(rungs)]
    for family in (f.name for f in LADDER_FAMILIES):
        label = result["best"].get(family)
        if label is None:
            lines.append(f"| {family} | fires on a healthy run at every setting |"
                         + " |" * len(rungs))
            continue
        cells = []
        for rung in rungs:
            row = result["settings"][label].get(rung)
            if row is None:
                cells.append("-")
                continue
            spent = row["spend"]
            cost = "" if spent is None else \
                f" ({100 * spent['recovered']:.0f}% + {100 * spent['probe']:.1f}%)"
            cells.append(f"{row['early_and_right']}/{row['dying']}{cost}")
        lines.append(f"| {family} | {label} | " + " | ".join(cells) + " |")
    lines += ["", f"Chosen for the held-out round: **{result['chosen']}**; Transformer "
              "Engine's rule at its best: " + ", ".join(
                  f"{family} **{label}**" for family, label in result["rivals"].items()) + ".",
              f"The oracle ({result['oracle']}) is shown, never chosen: it reads the fault."]
    return lines


def write_report(result: dict, traces: Path, stem: Path) -> None:
    lines = ["# The fault ladder's training round", "", *_lethality_lines(result), "",
             *_best_lines(result), "", f"Runs made on: {', '.join(result['cpus'])}."]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot_distributions(result, traces, stem.with_suffix(".png"))


def _values(traces: Path, pattern: str, name: str, faulted: bool) -> np.ndarray:
    """Per unit-step values of `name` on the faulted layers (twins) or every layer (healthy)."""
    out = []
    for path in sorted(traces.glob(pattern)):
        trace = detection_traces.read(path)
        values = trace.trace.measured.get(name)
        if values is None:
            continue
        layers = trace.fault_layers if faulted else range(values.shape[1])
        out.append(values[:, list(layers)].ravel())
    flat = np.concatenate(out) if out else np.array([])
    return flat[np.isfinite(flat)]


def plot_distributions(result: dict, traces: Path, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rungs = list(result["rungs"])
    figure, axes = plt.subplots(len(rungs), len(SHOWN), figsize=(4.2 * len(SHOWN),
                                                                 1.9 * len(rungs)),
                                squeeze=False)
    healthy = {name: _values(traces, "healthy-seed*.npz", name, False) for name, _ in SHOWN}
    for row, rung in enumerate(rungs):
        for column, (name, title) in enumerate(SHOWN):
            ax = axes[row][column]
            faulted = _values(traces, f"twin-{rung}-seed*.npz", name, True)
            both = np.concatenate([healthy[name], faulted])
            if both.size == 0:
                ax.set_axis_off()
                continue
            bins = np.linspace(np.percentile(both, 0.5), np.percentile(both, 99.5), 60)
            ax.hist(healthy[name], bins=bins, density=True, alpha=0.5, color="tab:green",
                    label="healthy runs, every layer")
            ax.hist(faulted, bins=bins, density=True, alpha=0.5, color="tab:red",
                    label="twins, faulted layers")
            ax.set_yticks([])
            if row == 0:
                ax.set_title(title, fontsize=9)
            if column == 0:
                r = result["rungs"][rung]
                ax.set_ylabel(f"{rung}\nlethal {r['lethal_at_exact']}/{r['judged']}",
                              fontsize=9)
    axes[0][0].legend(fontsize=7, loc="upper left")
    figure.suptitle("The kernel probe per unit-step: faulted layers against healthy ones, "
                    "rung by rung (the oracle's column reads the fault itself)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
