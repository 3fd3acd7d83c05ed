"""What the ladder's detectors see at the learning-rate edge, the failure nobody injected
(issue 56 item 5), from the traces of the uncontrolled FP8 arm (`probe-lrVALUE` in lr_edge,
`fp8-lrVALUE` in lr_edge_controller): FP8 at that LR, no control, with every detector's
quantity traced on the core attentions.

Each family is replayed at the one setting the ladder's training round chose for it (`best`
in the committed ladder.json), never re-tuned on these runs: per LR, the runs it fires on, its
first alarm, the layers it names and its spend, beside each run's fate (the step it diverged
at, or its final-loss gap to BF16 of the same seed and LR). The kernel probe's statistics are
also drawn per LR without any threshold (`plot`), so that what the natural failure looks like
to the probe can be read whatever a threshold says.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import numpy as np

from megatron_gnmr.experiments import detection_traces
from megatron_gnmr.experiments.detectors import LADDER_FAMILIES, ORACLE, first_alarm, settings, spend

TRACE = re.compile(r"^(?P<arm>.+)-lr(?P<lr>[0-9.e+-]+)-seed(?P<seed>\d+)\.npz$")
DRAWN = (("kernel_output_bias", "O's error, sign agreement (probe)"),
         ("kernel_delta_error", "delta's relative error (probe)"),
         ("fp8_underflow_o", "share of O that underflows E4M3 (TE's metric, with O)"))


def probe_traces(traces: Path, arm: str = "probe") -> dict[float, dict[int, Path]]:
    """{lr: {seed: trace path}} of the committed traces of `arm`, the uncontrolled FP8 arm
    that traces every detector's quantity (`probe` in lr_edge, `fp8` in lr_edge_controller)."""
    found: dict[float, dict[int, Path]] = {}
    for path in sorted(traces.glob(f"{arm}-lr*-seed*.npz")):
        match = TRACE.match(path.name)
        if match and match["arm"] == arm:
            found.setdefault(float(match["lr"]), {})[int(match["seed"])] = path
    return found


def chosen_settings(ladder_json: Path) -> dict[str, object] | None:
    """{family: Setting} as the ladder's training round chose them (None: no choice yet)."""
    if not ladder_json.is_file():
        return None
    best = json.loads(ladder_json.read_text()).get("best", {})
    by_label = {s.label: s for s in settings(among=LADDER_FAMILIES)}
    return {family: by_label[label] for family, label in best.items()
            if label is not None and label in by_label and family != ORACLE}


def fates(result: dict, arm: str = "probe") -> dict[tuple[float, int], dict]:
    """{(lr, seed): fate} of each run of `arm`, from compare-lr-edge's judged arms: the step it
    diverged at (None: it lived) and its final-loss gap to BF16 of the same LR and seed."""
    probe, bf16 = result["arms"].get(arm), result["arms"].get("bf16")
    out = {}
    for lr, row in (probe or {"rows": {}})["rows"].items():
        for seed, final in row["final"].items():
            reference = (bf16 or {"rows": {}})["rows"].get(lr, {}).get("final", {}).get(seed)
            out[(lr, seed)] = {"diverged": seed in row["diverged"],
                               "gap_to_bf16": None if seed in row["diverged"] or
                               reference is None else final - reference}
    return out


def replay(probes: dict[float, dict[int, Path]], chosen: dict, fate: dict) -> dict:
    """Per family and LR: each seed's first alarm (step, layers), spend and fate."""
    out: dict[str, dict[float, dict[int, dict]]] = {}
    for lr, by_seed in sorted(probes.items()):
        for seed, path in sorted(by_seed.items()):
            run = detection_traces.read(path)
            known = fate.get((lr, seed), {"diverged": run.diverged_at is not None,
                                          "gap_to_bf16": None})
            for family, setting in chosen.items():
                alarm = first_alarm(run.trace, setting)
                out.setdefault(family, {}).setdefault(lr, {})[seed] = {
                    "setting": setting.label, **known,
                    "first_alarm": None if alarm is None else alarm.step,
                    "layers": [] if alarm is None else
                    [_layer(run.trace.units[u]) for u in alarm.units],
                    "spend": spend(run.trace, setting)}
    return out


def _layer(unit: str) -> int:
    return int(re.search(r"layers\.(\d+)\.", unit)[1])


def lines(result: dict | None, probes: dict) -> list[str]:
    if not probes:
        return []
    head = ["", "## What the ladder's detectors see here (FP8, uncontrolled, every quantity "
            "traced)", ""]
    if result is None:
        return head + ["No ladder choice is committed yet (docs/runs/attention_ladder/"
                       "ladder.json): the detectors are not replayed; the probe's statistics "
                       "per LR are drawn in lr_edge_probe.png."]
    out = head + ["Each family at the setting the ladder's training round chose for it, "
                  "replayed on the uncontrolled FP8 runs: runs it fires on, its first "
                  "alarm (median step), the layers it names, its mean spend (share of "
                  "attention unit-steps it would run exact); the runs' fates: diverged (x) or "
                  "the final-loss gap to BF16 of the same seed.", "",
                  "| family (setting) | LR | fires | first alarm | layers named | spend | "
                  "fates |", "|---|---|---|---|---|---|---|"]
    for family, by_lr in result.items():
        for lr, by_seed in by_lr.items():
            rows = list(by_seed.values())
            alarms = [r["first_alarm"] for r in rows if r["first_alarm"] is not None]
            layers = sorted({layer for r in rows for layer in r["layers"]})
            fates = ", ".join("x" if r["diverged"] else
                              ("?" if r["gap_to_bf16"] is None else f"{r['gap_to_bf16']:+.3f}")
                              for r in rows)
            out.append(f"| {family} ({rows[0]['setting']}) | {lr:g} | {len(alarms)}/"
                       f"{len(rows)} | {statistics.median(alarms) if alarms else '-'} | "
                       f"{layers or '-'} | {statistics.fmean(r['spend'] for r in rows):.3f} | "
                       f"{fates} |")
    return out


def plot(probes: dict[float, dict[int, Path]], path: Path) -> None:
    """Per drawn statistic, its per-unit-step values at each LR (every seed pooled), as boxes:
    what the natural failure looks like to each quantity, no threshold involved."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lrs = sorted(probes)
    figure, axes = plt.subplots(1, len(DRAWN), figsize=(5 * len(DRAWN), 3.8))
    for axis, (name, title) in zip(axes, DRAWN):
        values = []
        for lr in lrs:
            pooled = [detection_traces.read(p).trace.measured.get(name)
                      for p in probes[lr].values()]
            pooled = np.concatenate([v.ravel() for v in pooled if v is not None] or [[]])
            values.append(pooled[np.isfinite(pooled)])
        axis.boxplot(values, whis=(1, 99), showfliers=False)
        axis.set_xticks(range(1, len(lrs) + 1), [f"{lr:g}" for lr in lrs])
        axis.set_xlabel("peak LR (FP8, uncontrolled)")
        axis.set_title(title, fontsize=9)
    figure.suptitle("The kernel probe and TE's metric per LR (boxes: quartiles, whiskers: "
                    "1st-99th percentile of unit-steps)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def plot_norms(traces: Path, path: Path) -> bool:
    """Per arm with committed traces, each core attention's gradient norm over the steps
    (every seed, log scale) above the training loss: where a run's attention blows up, and
    whether its controller held it. False when there is nothing to draw."""
    runs: dict[str, list] = {}
    for trace_path in sorted(traces.glob("*-lr*-seed*.npz")):
        arm = trace_path.name.split("-lr")[0]
        runs.setdefault(arm, []).append(detection_traces.read(trace_path))
    if not runs:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(2, len(runs), figsize=(3.6 * len(runs), 6), sharex=True,
                                sharey="row", squeeze=False)
    for column, (arm, seeds) in enumerate(runs.items()):
        norms, losses = axes[0][column], axes[1][column]
        for run in seeds:
            for unit, name in enumerate(run.trace.units):
                norms.plot(run.trace.steps, run.trace.norms[:, unit], lw=0.6,
                           color=f"C{_layer(name)}", alpha=0.7,
                           label=f"layer {_layer(name)}" if run is seeds[0] else None)
            losses.plot(run.trace.steps, run.loss, lw=0.6, alpha=0.8)
            if run.diverged_at is not None:
                losses.axvline(run.diverged_at, color="red", lw=0.6, ls="--")
        norms.set_yscale("log")
        norms.set_title(arm, fontsize=9)
        losses.set_xlabel("step")
        losses.set_ylim(3.5, 8.5)
    axes[0][0].set_ylabel("core attention's gradient norm")
    axes[1][0].set_ylabel("training loss (red: diverged)")
    axes[0][0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)
    return True
