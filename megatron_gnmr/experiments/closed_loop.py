"""`megatron-gnmr compare-closed-loop SCENARIO`: did the controller save the runs that die, at
what cost, and better than the same budget spent otherwise?

Per run, a compact summary is written once under `--summaries DIR` (committed: the tables and
the plot are rebuilt from the repository alone; `closed_loop_runs.py`). Per arm:
- diverged: the divergence rule of section 3 (the 20-step mean loss 20% above its running
  minimum); failed: diverged, or harmed: its final loss (mean of the last 300 steps) above
  exact attention's of the same seed by more than `closed_loop_statistics.harm_margin`;
- saved: runs that lived where the no-budget twin of the same seed (`loop-no-budget`, the
  same code path and trajectory until a recovery) diverged;
- the budget: the share of the core attentions' unit-steps (= their FLOPs: the units cost
  alike) run exact, over the steps each run actually ran, mean and standard error over runs;
- the final loss gap to exact attention of the same seed (runs that did not diverge), mean and
  standard error;
- that a controlled run followed its twin until its first recovery, at every 25th step.
Then Fisher's exact test, one-sided, of each loop's failures (and divergences) against each
other arm's, and a plot of every seed's loss curves.

Arms named `no-fault-*` run the same low path without the fault (a healthy run): nothing
there needs saving, so they are kept out of the saves and the tests, and get a table of
their own, the cost of being ready: the exact attention each rule spends for nothing, and
its loss against the healthy run left alone (`no-fault-no-control`) and against exact
attention of the same seed.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from megatron_gnmr.errors import UserError
from megatron_gnmr.experiments import closed_loop_earlier
from megatron_gnmr.experiments.closed_loop_runs import run_summary
from megatron_gnmr.experiments.closed_loop_statistics import (
    fisher_one_sided,
    harm_margin,
    mean_and_standard_error,
)
from megatron_gnmr.experiments.run_summaries import add_location_arguments, collect, locations

UNCONTROLLED, EXACT, TWIN = "no-control", "exact-attention", "loop-no-budget"
LOOPS = ("loop-early", "loop-early-cycle", "loop-trend")
HEALTHY, HEALTHY_UNCONTROLLED = "no-fault-", "no-fault-no-control"


def _short(commit: str) -> str:
    """A commit as printed: 12 characters of its hash, and `+dirty` kept (a run made on a
    tree that differed from it)."""
    head, dirty, _ = commit.partition("+dirty")
    return head[:12] + ("+dirty" if dirty else "")


def is_healthy(variant: str) -> bool:
    return variant.startswith(HEALTHY)


def _median(values) -> str:
    values = [v for v in values if v is not None]
    return f"{statistics.median(values):.0f}" if values else "-"


def _mean_se(values, percent: bool = False) -> str:
    result = mean_and_standard_error([v for v in values if v is not None])
    if result is None:
        return "-"
    mean, error = result
    n = len([v for v in values if v is not None])
    if percent:
        return f"{100 * mean:.1f}% +- {100 * error:.1f} (n={n})"
    return f"{mean:+.3f} +- {error:.3f} (n={n})"


def outcomes(table: dict[str, dict[int, dict]]) -> dict[str, dict[int, dict]]:
    """Per variant and seed: diverged, harmed, gap to exact (needs the exact arm)."""
    exact = table.get(EXACT, {})
    finals = [r["final_train_loss"] for r in exact.values() if r["diverged_at"] is None]
    margin = harm_margin(finals) if len(finals) > 1 else None
    out = {}
    for variant, runs in table.items():
        out[variant] = {}
        for seed, run in runs.items():
            gap = None
            if run["diverged_at"] is None and seed in exact and \
                    exact[seed]["diverged_at"] is None:
                gap = run["final_train_loss"] - exact[seed]["final_train_loss"]
            harmed = gap is not None and margin is not None and gap > margin
            out[variant][seed] = {"diverged": run["diverged_at"] is not None,
                                  "harmed": harmed, "gap": gap,
                                  "failed": run["diverged_at"] is not None or harmed}
    return {"margin": margin, **out}


def follows_twin(run: dict, twin: dict | None) -> bool | None:
    """The run's loss equals its twin's at every 25th step before its first recovery."""
    a, b = run["loss_every_25_steps"], twin["loss_every_25_steps"] if twin else {}
    if not a or not b or run["first_recovery"] is None:
        return None  # no twin, no recovery, or a run of an earlier round (no curve)
    shared = [s for s in a if s in b and int(s) < run["first_recovery"]]
    if not shared:
        return None  # recovered before the first step compared (25): nothing to check
    return all(a[s] == b[s] for s in shared)


def variant_rows(table: dict[str, dict[int, dict]]) -> list[dict]:
    verdicts = outcomes(table)
    twin = table.get(TWIN, {})
    rows = []
    for variant, runs in table.items():
        if is_healthy(variant):
            continue
        result = verdicts[variant]
        leads = [twin[s]["diverged_at"] - r["first_recovery"] for s, r in runs.items()
                 if r["first_recovery"] is not None and twin.get(s, {}).get("diverged_at")]
        twin_died = [s for s in runs if twin.get(s, {}).get("diverged_at") is not None]
        saved = [s for s in twin_died if not result[s]["diverged"]]
        checks = [follows_twin(r, twin.get(s)) for s, r in runs.items()]
        checks = [c for c in checks if c is not None]
        rows.append({
            "arm": variant,
            "diverged": f"{sum(v['diverged'] for v in result.values())} / {len(runs)}",
            "failed (diverged or harmed)": f"{sum(v['failed'] for v in result.values())} / "
                                           f"{len(runs)}",
            "saved where its twin diverged": f"{len(saved)} / {len(twin_died)}"
            if twin_died and variant not in (TWIN, UNCONTROLLED, EXACT) else "-",
            "attention FLOPs exact (of the steps run)": _mean_se(
                [r["recovered_share_of_executed_steps"] for r in runs.values()], percent=True),
            "first alarm (median step)": _median(r["first_attention_alarm"]
                                                 for r in runs.values()),
            "first recovery (median step)": _median(r["first_recovery"] for r in runs.values()),
            "lead over the twin's divergence (median)": _median(leads),
            "final loss gap to exact": _mean_se([v["gap"] for v in result.values()]),
            "follows its twin until its first recovery": f"{sum(checks)} / {len(checks)}"
            if checks else "-",
        })
    return rows


def comparisons(table: dict[str, dict[int, dict]]) -> list[dict]:
    """Each loop against each other arm: Fisher's one-sided p in both directions, that the
    loop fails (and diverges) less often, and that the other arm does."""
    verdicts = outcomes(table)
    rows = []
    for loop in (v for v in LOOPS if v in table):
        mine = verdicts[loop]
        for other in table:
            if other in (loop, EXACT) or is_healthy(other):
                continue
            theirs = verdicts[other]
            row = {"loop": loop, "against": other}
            for name in ("failed", "diverged"):
                a = sum(v[name] for v in mine.values())
                b = sum(v[name] for v in theirs.values())
                row[name] = f"{a}/{len(mine)} vs {b}/{len(theirs)}, p = " \
                            f"{fisher_one_sided(a, len(mine), b, len(theirs)):.3g} (the loop " \
                            f"less), {fisher_one_sided(b, len(theirs), a, len(mine)):.3g} " \
                            "(the other less)"
            rows.append(row)
    return rows


def healthy_rows(table: dict[str, dict[int, dict]]) -> list[dict]:
    """The cost of being ready, per healthy arm: what it spent, and what that did to its
    loss (gaps per seed, to the healthy run left alone and to exact attention)."""
    verdicts, alone = outcomes(table), table.get(HEALTHY_UNCONTROLLED, {})
    rows = []
    for variant, runs in ((v, r) for v, r in table.items() if is_healthy(v)):
        to_alone = [r["final_train_loss"] - alone[s]["final_train_loss"] for s, r in runs.items()
                    if s in alone and r["diverged_at"] is None and
                    alone[s]["diverged_at"] is None]
        rows.append({
            "arm (no fault)": variant,
            "diverged": f"{sum(v['diverged'] for v in verdicts[variant].values())} / "
                        f"{len(runs)}",
            "attention FLOPs exact, spent for nothing": _mean_se(
                [r["recovered_share_of_executed_steps"] for r in runs.values()], percent=True),
            "first recovery (median step)": _median(r["first_recovery"] for r in runs.values()),
            "final loss gap to the healthy run left alone":
                _mean_se(to_alone) if variant != HEALTHY_UNCONTROLLED else "-",
            "final loss gap to exact": _mean_se([v["gap"] for v in verdicts[variant].values()]),
        })
    return rows


def _markdown_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    columns = list(rows[0])
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
            *["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]]


def markdown(table: dict, earlier: list[str] = ()) -> str:
    verdicts = outcomes(table)
    runs = [r for arm in table.values() for r in arm.values()]
    cpus = sorted({r.get("cpu") or "?" for r in runs})
    commits = sorted({c for r in runs for c in r.get("commits", [])})
    margin = verdicts["margin"]
    lines = _markdown_table(variant_rows(table))
    lines += ["", f"Harmed: final loss above exact attention's of the same seed by more than "
                  f"{margin:.3f} (twice exact attention's seed-to-seed standard deviation)."
              if margin is not None else "Harmed: needs two exact-attention runs.", ""]
    lines += _markdown_table(comparisons(table))
    healthy = healthy_rows(table)
    if healthy:
        lines += ["", "The cost of being ready (the same low path without the fault):", "",
                  *_markdown_table(healthy)]
    lines += ["", f"Runs made on: {', '.join(cpus)} (pairs by seed are bitwise comparable only "
                  f"on one CPU); code: {', '.join(_short(c) for c in commits) or '?'}."]
    if earlier:
        lines += ["", f"From the earlier round (same CPU model, no loss curve): "
                      f"{', '.join(earlier)}."]
    return "\n".join(lines) + "\n"


def plot(table: dict, path: Path) -> None:
    """Every seed's loss curves, one panel per seed, one line per arm (the arms with the
    fault: the healthy ones are in their own table)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = {variant: runs for variant, runs in table.items() if not is_healthy(variant)}
    seeds = sorted({s for runs in table.values() for s in runs})
    columns = 4
    rows = -(-len(seeds) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4 * columns, 2.6 * rows), sharey=True,
                                squeeze=False)
    colors = {variant: f"C{i % 10}" for i, variant in enumerate(table)}  # one per arm
    for ax, seed in zip(axes.flat, seeds):
        for variant, runs in table.items():
            if seed in runs and runs[seed]["loss_every_25_steps"]:
                curve = runs[seed]["loss_every_25_steps"]
                ax.plot([int(s) for s in curve], list(curve.values()), label=variant,
                        color=colors[variant],
                        linewidth=1.2 if variant.startswith("loop-early") else 0.8)
        ax.set_title(f"seed {seed}", fontsize=9)
        ax.set_ylim(3.5, 7.0)
    for ax in axes.flat[len(seeds):]:
        ax.axis("off")
    handles = {line.get_label(): line for ax in axes.flat for line in ax.get_lines()}
    figure.legend(handles.values(), handles.keys(), loc="lower center", fontsize=8,
                  ncol=min(len(handles), 5))
    figure.supxlabel("step", y=0.045)
    figure.supylabel("training loss")
    figure.tight_layout(rect=(0, 0.05, 1, 1))
    figure.savefig(path, dpi=90)
    plt.close(figure)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="a scenario whose runs stop once diverged "
                        "(attention_closed_loop)")
    add_location_arguments(parser)
    parser.add_argument("--earlier", default=None, metavar="DIR", help="summaries of an "
                        "earlier round made on the same CPU model (e.g. docs/runs/"
                        "attention_closed_loop_issue30) for the arms and seeds this round lacks")
    parser.add_argument("--plot", default=None, help="the loss curves' PNG (default: "
                        "SUMMARIES/loss_curves.png)")


def run(args: argparse.Namespace) -> str:
    scenario, runs, summaries = locations(args)
    table = collect(scenario, runs, summaries, run_summary)
    added = []
    if args.earlier:
        added = closed_loop_earlier.merge(table, Path(args.earlier), scenario.variants,
                                          scenario.seeds)
    if not table:
        raise UserError(f"compare-closed-loop {scenario.name}: no finished run in {runs} and "
                        f"no summary in {summaries}")
    text = markdown(table, added)
    (summaries / "table.md").write_text(text)
    plot(table, Path(args.plot) if args.plot else summaries / "loss_curves.png")
    print(text)
    return text
