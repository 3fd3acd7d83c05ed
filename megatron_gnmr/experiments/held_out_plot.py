"""The held-out round's picture: one seed's loss curves (the twin that dies, each rule's run,
the healthy run and exact attention, with the twin's death, the onset of harm and each rule's
first recovery marked), and every seed's outcome per rule (its final loss gap to exact
attention against the harm margin; a cross where it diverged)."""

from __future__ import annotations

from pathlib import Path

SMOOTH = 4  # points of 25 steps: a 100-step running mean


def _curve(summary: dict) -> tuple[list[int], list[float]]:
    points = sorted((int(s), v) for s, v in summary["loss_every_25_steps"].items())
    steps, losses = [s for s, _ in points], [v for _, v in points]
    smooth = [sum(losses[max(0, i - SMOOTH + 1): i + 1]) / len(losses[max(0, i - SMOOTH + 1):
                                                                       i + 1])
              for i in range(len(losses))]
    return steps, smooth


def plot_seed(table: dict, result: dict, seed: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8),
                                         gridspec_kw={"width_ratios": [3, 2]})
    names = ["twin", *result["rules"], "healthy", "exact-attention"]
    labels = {"twin": "no control (dies)", "healthy": "healthy run (no fault)",
              "exact-attention": "exact attention"}
    colors = {}
    for name in names:
        summary = table.get(name, {}).get(seed)
        if summary is None:
            continue
        steps, losses = _curve(summary)
        line, = left.plot(steps, losses, label=labels.get(name, name), lw=1.2)
        colors[name] = line.get_color()
        if name in result["rules"] and summary.get("first_recovery"):
            left.axvline(summary["first_recovery"], color=line.get_color(), ls=":", lw=1)
    # the early losses (about 8) would flatten the curves that matter: cut the top first, so
    # the labels below sit inside the axes
    left.set_ylim(top=min(left.get_ylim()[1], 6.0))
    verdict = next(iter(result["rules"].values()))[seed] if result["rules"] else {}
    if verdict.get("twin_died_at"):
        left.axvline(verdict["twin_died_at"], color="black", lw=1)
        left.text(verdict["twin_died_at"], left.get_ylim()[1], " dies", va="top", fontsize=8)
    if verdict.get("onset"):
        left.axvline(verdict["onset"], color="grey", ls="--", lw=1)
        left.text(verdict["onset"], left.get_ylim()[1], " harm begins", va="top", fontsize=8,
                  color="grey")
    left.set(xlabel="step", ylabel="training loss (100-step mean)",
             title=f"held-out seed {seed} (dotted: each rule's first recovery)")
    left.legend(fontsize=8, frameon=False)
    for x, (rule, seeds) in enumerate(result["rules"].items()):
        for verdict in seeds.values():
            if not verdict["ran"] or not verdict["twin_died_at"]:
                continue
            if verdict["diverged"]:
                right.scatter(x, 0.25, marker="x", color=colors.get(rule, "black"))
            else:
                right.scatter(x, verdict["gap"], color=colors.get(rule, "black"), alpha=0.7)
    right.axhline(result["harm_margin"], color="grey", ls="--", lw=1)
    right.text(0.5, result["harm_margin"], "harm margin", fontsize=8, color="grey", va="bottom",
               ha="center")
    right.set_xticks(range(len(result["rules"])), list(result["rules"]), fontsize=8)
    right.set(ylabel="final loss gap to exact attention (x: diverged)",
              title=f"every held-out seed ({len(result['seeds'])})")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
