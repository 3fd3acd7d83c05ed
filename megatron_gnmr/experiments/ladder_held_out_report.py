"""`megatron-gnmr compare-ladder-held-out SCENARIO`: the fault ladder's held-out round as a
reader wants it (issue 56): per killing rung, a table of every arm over the seeds whose twin
died, the paired and unpaired tests against the chosen arm, the issue's goal, the rungs run
as twins alone with every rule replayed on them, and one picture of every run's fate
(DIR/held_out.{md,png}). Built from `ladder_verdicts.judge_round`'s result, so it rebuilds
from the committed summaries and traces.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

from megatron_gnmr.experiments.ladder_goal import CHOSEN, GOAL, dying_seeds
from megatron_gnmr.experiments.ladder_verdicts import judge_round
from megatron_gnmr.experiments.run_summaries import add_location_arguments


def _p(value: float) -> str:
    return f"{value:.2g}"


def _arm_row(arm: str, per_seed: dict, versus: dict | None) -> str:
    dying = dying_seeds(per_seed)
    saved = {name: sum(not v[f"failed_at_{name}"] for v in dying.values())
             for name in ("exact", "healthy")}
    gaps = [v["gap"] for v in dying.values() if v["gap"] is not None]
    spends = [(v["recovered"], v["probe"]) for v in dying.values()
              if v["recovered"] is not None and v["probe"] is not None]
    acted = sum(v["healthy_fires_at"] is not None for v in per_seed.values())
    healthy = [v["healthy_spend"] for v in per_seed.values() if v["healthy_traced"]]
    spend = "-" if not spends else (f"{statistics.fmean(r for r, _ in spends):.1%} + "
                                    f"{statistics.fmean(p for _, p in spends):.1%}")
    healthy_spend = "-" if not healthy or None in healthy else f"{statistics.fmean(healthy):.2%}"
    tests = "-" if versus is None else " / ".join(
        f"{_p(versus[key][f'sign_p_{side}_better'])} ({_p(versus[key][f'fisher_p_{side}_better'])})"
        for side in ("chosen", "rival") for key in ("failed_at_exact", "failed_at_healthy"))
    healthy_tests = "-" if versus is None else " / ".join(
        f"{_p(versus['healthy'][f'sign_p_{side}_better'])} "
        f"({_p(versus['healthy'][f'fisher_p_{side}_better'])})" for side in ("chosen", "rival"))
    return (f"| {arm} | {len(dying)} | {saved['exact']} | {saved['healthy']} | "
            f"{sum(v['diverged'] for v in dying.values())} | "
            f"{', '.join(f'{g:+.3f}' for g in gaps) or '-'} | {spend} | {tests} | "
            f"{acted}/{len(per_seed)} | {healthy_spend} | {healthy_tests} |")


def _goal_line(goal: dict, complete: bool) -> str:
    need = math.ceil(GOAL["saved"] * goal["died"] / 16)
    beats = "; ".join(f"{arm}: " + ", ".join(f"{test} {'yes' if won else 'no'}"
                                              for test, won in tests.items())
                      for arm, tests in goal["beats"].items())
    saved = ", ".join(f"{count} at the {name} margin" for name, count in goal["saved"].items())
    probe = "unmeasured" if goal["probe_share"] is None else f"{goal['probe_share']:.2%}"
    healthy = "-" if goal["healthy_spend"] is None else f"{goal['healthy_spend']:.2%}"
    if goal["met"] is not None:
        verdict = "Met" if goal["met"] else "Not met"
    elif not complete:
        verdict = "Not judged: the round is incomplete"
    elif not goal["qualifies"]:
        verdict = (f"Not judged: the twins died on {goal['died']} of {goal['seeds']} seeds, "
                   "fewer than half")
    else:
        verdict = "Not judged"
    return (f"Goal: of {goal['died']} dying runs, saved {saved} (needs {need} at each: 14 of "
            f"16 scaled; a chosen run not judged counts as not saved); healthy runs acted on "
            f"{goal['healthy_acted']} (at most {GOAL['healthy_acted']}), spending {healthy} on "
            f"a healthy run; the probe {probe} of the attention's FLOPs (at most "
            f"{GOAL['probe_share']:.0%}); against each of TE's arms run, paired p < "
            f"{GOAL['p']} on failures at each margin and no more healthy spend: {beats or '-'}. "
            f"**{verdict}.**")


def _replays_disagree(result: dict) -> list[str]:
    """Where a live healthy-ARM run's first recovery is not the step its replay named."""
    seen = set()
    for judged in result["rungs"].values():
        for arm, per_seed in judged["arms"].items():
            for seed, v in per_seed.items():
                live, replay = v.get("healthy_live_first_recovery"), v["healthy_fires_at"]
                if v.get("healthy_live_ran") and live != replay:
                    seen.add(f"healthy-{arm} seed {seed} (live {live}, replay {replay})")
    return sorted(seen)


def lines(result: dict) -> list[str]:
    margins = result["margins"]
    out = ["# The fault ladder's held-out round", "",
           f"Harm margins, the training round's: {margins['exact']:.4f} (exact attention's) and "
           f"{margins['healthy']:.4f} (the healthy FP8 runs'). An arm is judged on the seeds "
           "whose twin died: saved unharmed when it did not diverge and ended within the margin "
           "of exact attention of its seed (final loss, mean of the last 300 steps). Spend: "
           "the share of the core attentions' unit-steps it ran exact + the kernel probe's "
           "FLOPs on the rest (TE's metrics at no cost). Acted on a healthy run: its replay on "
           "the healthy trace fires; its healthy spend is then its live healthy run's. Tests "
           "against the chosen arm, one-sided each way: the paired sign test over the seeds "
           "both can be judged on (Fisher's exact test). A run made on another CPU model than "
           "its twin's and exact attention's is not judged. TE's arms are those the round ran "
           "(its training round's best settings: latched, unlatched, and latched with O)."]
    elsewhere = sorted({f"{arm}@{rung} seed {seed}" for rung, judged in result["rungs"].items()
                        for arm, per_seed in judged["arms"].items()
                        for seed, v in per_seed.items() if v.get("other_cpu")})
    if elsewhere:
        out += ["", f"Made on another CPU model than their seed's twin and exact attention, so "
                f"never judged: {', '.join(elsewhere)}."]
    superseded = result.get("superseded") or {}
    if superseded:
        out += ["", "Made again whole, their first CPU model not having come back to finish "
                "them (results.md, section 14): the first runs are kept in superseded/ and "
                "never judged: "
                + "; ".join(f"seed {seed} ({entry['runs']} runs on {', '.join(entry['cpus'])})"
                            for seed, entry in sorted(superseded.items(),
                                                      key=lambda item: int(item[0]))) + "."]
    if not result.get("complete", True):
        out += ["", "**The round is not complete** (a seed lacks a twin, exact attention or "
                "a healthy trace, or an arm has not run where its twin died or where its replay "
                "fires on the healthy run): no goal is met or missed yet."]
    if not result.get("arms_complete", True):
        out += ["", "**Not every arm has run yet**: the arms the goal does not read (the "
                "first-layer rule, random) are partial in the tables below."]
    disagree = _replays_disagree(result)
    if disagree:
        out += ["", f"**A live healthy run did not first recover where its replay did**: "
                f"{', '.join(disagree)}."]
    for rung, judged in result["rungs"].items():
        twins = next(iter(judged["arms"].values()), {})
        died = sorted(v["twin_died_at"] for v in twins.values() if v["twin_died_at"])
        out += ["", f"## {rung}: the twin died on {len(died)} of {len(twins)} seeds"
                f"{f' (median step {statistics.median(died):.0f})' if died else ''}", "",
                "| arm | dying seeds judged | saved (exact margin) | saved (healthy margin) | "
                "diverged | gaps to exact of those that lived | spend | p on failures, chosen "
                "better at exact / healthy margin, then rival better: sign (Fisher) | healthy "
                "acted on | healthy spend | p on healthy acted on, chosen / rival better |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for arm, per_seed in judged["arms"].items():
            out.append(_arm_row(arm, per_seed, None if arm == CHOSEN
                                else judged["versus_chosen"].get(arm)))
        out += ["", _goal_line(judged["goal"], result.get("complete", True))]
    out += _secondary_lines(result.get("secondary", {}), result.get("secondary_complete", True))
    if result.get("cpus"):
        out += ["", f"Runs made on: {', '.join(result['cpus'])}."]
    return out


def _secondary_lines(secondary: dict, whole: bool) -> list[str]:
    """The twins no arm ran beside: what each arm's rule would do on them, replayed."""
    if not secondary:
        return []
    out = ["", "## Twins no arm ran beside (rungs run alone, a killing rung's twins that "
           "lived): every arm's rule replayed on them", "",
           *([] if whole else ["**Not every twin run alone has run yet**: this table is "
                               "partial (the goal reads none of it).", ""]),
           "| rung | twins' gaps to exact (x: died; ?: exact attention not paired) | arm | "
           "fires | first recovery (median step) | names a faulted layer |",
           "|---|---|---|---|---|---|"]
    for rung, by_arm in secondary.items():
        for arm, per_seed in by_arm.items():
            fired = [v for v in per_seed.values() if v["fires_at"] is not None]
            fates = ", ".join("x" if v["twin_died_at"] else
                              ("?" if v["gap"] is None else f"{v['gap']:+.3f}")
                              for v in per_seed.values())
            steps = [v["fires_at"] for v in fired]
            out.append(f"| {rung} | {fates or '-'} | {arm} | {len(fired)}/{len(per_seed)} | "
                       f"{statistics.median(steps) if steps else '-'} | "
                       f"{sum(bool(v['names_faulted']) for v in fired)}/{len(fired)} |")
    return out


def plot(result: dict, path: Path) -> None:
    """Per rung, every arm's runs on the seeds whose twin died: the final-loss gap to exact
    attention of the seed, a cross at the top for a run that diverged; both margins drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rungs = list(result["rungs"])
    if not rungs:
        return
    figure, axes = plt.subplots(1, len(rungs), figsize=(6 * len(rungs), 4), squeeze=False)
    for axis, rung in zip(axes[0], rungs):
        arms = result["rungs"][rung]["arms"]
        gaps = [v["gap"] for per_seed in arms.values() for v in dying_seeds(per_seed).values()
                if v["gap"] is not None]
        top = max([*gaps, 2 * result["margins"]["healthy"]]) * 1.15
        for x, (arm, per_seed) in enumerate(arms.items()):
            dying = list(dying_seeds(per_seed).values())
            lived = [v["gap"] for v in dying if not v["diverged"]]
            axis.scatter([x] * len(lived), lived, s=18, alpha=0.7, color="tab:blue")
            crosses = sum(v["diverged"] for v in dying)
            if crosses:
                axis.scatter([x], [top], marker="x", color="tab:red")
                axis.annotate(f"{crosses} diverged", (x, top), textcoords="offset points",
                              xytext=(0, -12), ha="center", fontsize=7, color="tab:red")
        for name, style in (("exact", ":"), ("healthy", "--")):
            axis.axhline(result["margins"][name], color="gray", linestyle=style,
                         label=f"margin ({name})")
        axis.set_xticks(range(len(arms)), list(arms), rotation=30, fontsize=8)
        axis.set_xlim(-0.5, len(arms) - 0.5)
        axis.set_title(f"{rung}: runs whose twin died (x: diverged)", fontsize=9)
        axis.set_ylabel("final loss - exact attention's")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def write_report(result: dict, stem: Path) -> None:
    stem.with_suffix(".md").write_text("\n".join(lines(result)) + "\n")
    plot(result, stem.with_suffix(".png"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="the held-out scenario (attention_ladder_heldout)")
    add_location_arguments(parser)
    parser.add_argument("--training", default="docs/runs/attention_ladder/ladder.json",
                        help="the training round's result (its harm margins)")


def run(args: argparse.Namespace) -> dict:
    result, summaries = judge_round(args)
    write_report(result, summaries / "held_out")
    print((summaries / "held_out.md").read_text())
    return result
