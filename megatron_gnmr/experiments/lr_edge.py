"""`megatron-gnmr compare-lr-edge SCENARIO`: the learning-rate edge (issue 56 item 5), as
Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer training
instabilities") measure it: the final loss of each arm (`ARM-lrVALUE` variants: BF16, FP8,
...) against the peak learning rate, over seeds, from the committed run summaries alone.

- final loss: the mean training loss over the last 300 steps; a run that diverged (the
  divergence rule of section 3) counts as the loss it started from (Wortsman's
  min(loss, initial loss): it learnt nothing that lasted);
- an arm fails at an LR where a seed diverged, or where its mean final loss is more than
  `TOLERANCE` above its own best over the grid; its **edge** is the largest LR reached from
  its best LR upwards without a failure; its **divergence edge** the largest reached without a
  diverged seed (a run that trains, however badly, does not end it);
- LR sensitivity: the mean over the grid of (final loss - the arm's best), Wortsman's
  E_eta[min(l(eta), l_0) - l*];
- per LR, FP8 against BF16 seed for seed (the same data and initial weights): the gap's mean
  and the number of seeds on which FP8 is worse.
Writes DIR/lr_edge.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from megatron_gnmr.errors import UserError
from megatron_gnmr.experiments.closed_loop_runs import run_summary
from megatron_gnmr.experiments.run_summaries import add_location_arguments, collect, locations

VARIANT = re.compile(r"^(?P<arm>.+)-lr(?P<lr>[0-9.e+-]+)$")
TOLERANCE = 0.1  # nats above the arm's best: the run trains, but the LR has cost it


def final_loss(summary: dict) -> float:
    if summary["diverged_at"] is not None or summary["final_train_loss"] is None:
        return summary["initial_loss"]
    return summary["final_train_loss"]


def _summary(run_dir) -> dict:
    """The run's summary and the validation loss it started from (its step-0 evaluation)."""
    summary = run_summary(run_dir)
    summary["initial_loss"] = json.loads((run_dir / "summary.json").read_text()).get(
        "initial_valid_loss")
    return summary


def by_arm(table: dict) -> dict[str, dict[float, dict[int, dict]]]:
    """{variant: runs} -> {arm: {lr: runs}}."""
    arms: dict[str, dict[float, dict[int, dict]]] = {}
    for variant, by_seed in table.items():
        match = VARIANT.match(variant)
        if match is None:
            raise UserError(f"compare-lr-edge: variant {variant!r} is not ARM-lrVALUE")
        arms.setdefault(match["arm"], {})[float(match["lr"])] = by_seed
    return arms


def judge(table: dict) -> dict:
    arms = by_arm(table)
    out = {"tolerance": TOLERANCE, "arms": {}}
    for arm, by_lr in arms.items():
        rows = {}
        for lr in sorted(by_lr):
            runs = by_lr[lr]
            losses = {seed: final_loss(s) for seed, s in runs.items()}
            rows[lr] = {"seeds": sorted(runs), "final": losses,
                        "cpu": {seed: r.get("cpu") for seed, r in runs.items()},
                        "mean": statistics.fmean(losses.values()) if losses else None,
                        "diverged": sorted(s for s, r in runs.items()
                                           if r["diverged_at"] is not None)}
        best_lr = min(rows, key=lambda lr: rows[lr]["mean"])
        best = rows[best_lr]["mean"]
        for row in rows.values():
            row["fails"] = bool(row["diverged"]) or row["mean"] > best + TOLERANCE
        out["arms"][arm] = {"rows": rows, "best": best,
                            "edge": _reached(rows, best_lr, lambda row: row["fails"]),
                            "divergence_edge": _reached(rows, best_lr,
                                                        lambda row: bool(row["diverged"])),
                            "sensitivity": statistics.fmean(r["mean"] - best
                                                            for r in rows.values())}
    if {"bf16", "fp8"} <= set(out["arms"]):
        out["paired"] = _paired(out["arms"]["fp8"]["rows"], out["arms"]["bf16"]["rows"])
    if "bf16" in out["arms"]:
        out["against_bf16"] = {arm: _paired(out["arms"][arm]["rows"], out["arms"]["bf16"]["rows"])
                               for arm in out["arms"] if arm != "bf16"}
        for arm, by_lr in arms.items():
            for lr, runs in by_lr.items():
                if arm != "bf16" and lr in out["against_bf16"][arm]:
                    out["against_bf16"][arm][lr].update(_control(runs))
    return out


def _control(runs: dict[int, dict]) -> dict:
    """What an arm's controller did over its seeds: the mean share of the core attentions'
    unit-steps it ran exact (of the steps each run made), and the layers it ever recovered."""
    layers = sorted({int(re.search(r"layers\.(\d+)\.", unit)[1])
                     for r in runs.values() for unit in r.get("recoveries", {})
                     if re.search(r"layers\.(\d+)\.", unit)})
    return {"spend": statistics.fmean(r.get("recovered_share_of_executed_steps", 0.0)
                                      for r in runs.values()), "layers": layers}


def _reached(rows: dict, start: float, fails) -> float:
    """The largest LR reached from `start` upwards before the first row that `fails`."""
    edge = start
    for lr in (lr for lr in rows if lr > start):
        if fails(rows[lr]):
            break
        edge = lr
    return edge


def _paired(arm: dict, bf16: dict) -> dict:
    """Per LR both arms ran: the arm - BF16 per shared seed made on one CPU model (runs pair
    only there: GEMMs round differently on another), its mean, and the arm's worse seeds."""
    paired = {}
    for lr in sorted(set(arm) & set(bf16)):
        shared = sorted(set(arm[lr]["final"]) & set(bf16[lr]["final"]))
        seeds = [s for s in shared if arm[lr]["cpu"].get(s) == bf16[lr]["cpu"].get(s)]
        gaps = [arm[lr]["final"][s] - bf16[lr]["final"][s] for s in seeds]
        paired[lr] = {"gaps": gaps, "mean_gap": statistics.fmean(gaps) if gaps else None,
                      "worse": sum(g > 0 for g in gaps), "seeds": len(gaps),
                      "other_cpu": len(shared) - len(seeds)}
    return paired


def table_lines(result: dict) -> list[str]:
    arms = result["arms"]
    lrs = sorted({lr for arm in arms.values() for lr in arm["rows"]})
    lines = [f"Final loss (mean of the last 300 steps; a diverged run counts its initial loss) "
             f"per arm and peak LR, mean over seeds; x: a seed diverged; a row fails where a "
             f"seed diverged or the mean is more than {result['tolerance']} above the arm's "
             "best.", "",
             "| arm | " + " | ".join(f"{lr:g}" for lr in lrs) +
             " | edge | divergence edge | LR sensitivity |",
             "|---|" + "---|" * (len(lrs) + 3)]
    for name, arm in arms.items():
        cells = []
        for lr in lrs:
            row = arm["rows"].get(lr)
            if row is None:
                cells.append("-")
                continue
            mark = f" x{len(row['diverged'])}" if row["diverged"] else ""
            cells.append(f"{'**' if row['fails'] else ''}{row['mean']:.3f}{mark}"
                         f"{'**' if row['fails'] else ''}")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {arm['edge']:g} | "
                     f"{arm['divergence_edge']:g} | {arm['sensitivity']:.3f} |")
    if result.get("against_bf16"):
        lines += ["", "Each arm against BF16, seed for seed (same data and initial weights; a "
                  "diverged run counts its initial loss); the controller's spend is the share "
                  "of the core attentions' unit-steps it ran exact, and the layers it ever "
                  "recovered:", "",
                  "| arm | LR | mean gap to BF16 | seeds worse | gaps | spend | layers recovered |",
                  "|---|---|---|---|---|---|---|"]
        for arm, by_lr in result["against_bf16"].items():
            for lr, row in by_lr.items():
                if not row["seeds"]:
                    if row["other_cpu"]:
                        lines.append(f"| {arm} | {lr:g} | - | - | ({row['other_cpu']} seeds "
                                     "made on another CPU model than BF16's: not paired) "
                                     "| - | - |")
                    continue
                lines.append(f"| {arm} | {lr:g} | {row['mean_gap']:+.4f} | {row['worse']}/"
                             f"{row['seeds']} | {', '.join(f'{g:+.3f}' for g in row['gaps'])} "
                             f"| {row.get('spend', 0.0):.3f} | {row.get('layers') or '-'} |")
    return lines


def plot(result: dict, table: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, arm in result["arms"].items():
        lrs = sorted(arm["rows"])
        line, = left.plot(lrs, [arm["rows"][lr]["mean"] for lr in lrs], marker="o", label=name)
        for lr in lrs:
            finals = list(arm["rows"][lr]["final"].values())
            left.scatter([lr] * len(finals), finals, s=10, color=line.get_color(), alpha=0.5)
        for lr in lrs[-3:]:
            for seed, summary in table[f"{name}-lr{_spelled(lr, table, name)}"].items():
                curve = summary["loss_every_25_steps"]
                steps = sorted(curve, key=int)
                right.plot([int(s) for s in steps], [curve[s] for s in steps],
                           color=line.get_color(), alpha=0.35, lw=0.8)
    left.set_xscale("log")
    left.set_xlabel("peak learning rate")
    left.set_ylabel("final training loss (diverged: initial)")
    left.legend()
    left.set_title("the LR edge: final loss against the peak LR")
    right.set_xlabel("step")
    right.set_ylabel("training loss")
    right.set_ylim(top=min(9.0, right.get_ylim()[1]))
    right.set_title("the three highest LRs, every seed")
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def _spelled(lr: float, table: dict, arm: str) -> str:
    """The variant's own spelling of `lr` (0.003, not 3e-3)."""
    return next(VARIANT.match(v)["lr"] for v in table
                if VARIANT.match(v)["arm"] == arm and float(VARIANT.match(v)["lr"]) == lr)


def _detector_lines(result: dict, summaries: Path, ladder: Path, arm: str) -> list[str]:
    """The traced arm's section: the ladder's chosen detectors replayed on its runs, and the
    probe's statistics per LR drawn (lr_edge_detectors)."""
    from megatron_gnmr.experiments import lr_edge_detectors as seen

    drawn = seen.plot_norms(summaries / "traces", summaries / "lr_edge_norms.png")
    probes = seen.probe_traces(summaries / "traces", arm)
    if not probes:
        return ["", "Each traced run's core-attention gradient norms and loss: "
                "lr_edge_norms.png."] if drawn else []
    seen.plot(probes, summaries / "lr_edge_probe.png")
    chosen = seen.chosen_settings(ladder)
    replayed = None if chosen is None else seen.replay(probes, chosen, seen.fates(result, arm))
    if replayed is not None:
        result["detectors"] = {family: {str(lr): runs for lr, runs in by_lr.items()}
                               for family, by_lr in replayed.items()}
    return seen.lines(replayed, probes)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="an LR sweep scenario (lr_edge)")
    add_location_arguments(parser)
    parser.add_argument("--ladder", default="docs/runs/attention_ladder/ladder.json",
                        help="the ladder's committed choice, whose detectors are replayed on "
                        "the traced arm (default: %(default)s)")
    parser.add_argument("--sweep", type=Path, default=None,
                        help="a controlled round's goal (lr_edge_arms): the full sweep's "
                        "committed result it was chosen from (docs/runs/lr_edge/lr_edge.json)")
    parser.add_argument("--traced-arm", default="probe",
                        help="the uncontrolled FP8 arm that traces every detector's quantity, "
                        "whose runs the detectors are replayed on (default: %(default)s; "
                        "lr_edge_controller's is fp8)")


def run(args: argparse.Namespace) -> dict:
    scenario, runs, summaries = locations(args)
    table = collect(scenario, runs, summaries, _summary)
    if not table:
        raise UserError(f"compare-lr-edge: no finished run under {runs} or {summaries}")
    result = judge(table)
    cpus = sorted({r.get("cpu") or "?" for arm in table.values() for r in arm.values()})
    lines = [*table_lines(result), "", f"Runs made on: {', '.join(cpus)}.",
             *_detector_lines(result, summaries, Path(args.ladder), args.traced_arm)]
    if args.sweep is not None:
        from megatron_gnmr.experiments import lr_edge_goal

        if not args.sweep.is_file():
            raise UserError(f"compare-lr-edge --sweep {args.sweep}: no such file")
        goal, complete = lr_edge_goal.judge_round(result, by_arm(table), scenario, table,
                                                  summaries, args.sweep, args.traced_arm)
        result["goal"] = {**goal, "complete": complete}
        lines += lr_edge_goal.lines(goal, complete)
    (summaries / "lr_edge.md").write_text("\n".join(lines) + "\n")
    (summaries / "lr_edge.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, table, summaries / "lr_edge.png")
    print("\n".join(lines))
    return result
