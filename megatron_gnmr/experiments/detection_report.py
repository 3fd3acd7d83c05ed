"""The detection study's table (markdown) and its trade-off plot: for each detector family, as
its threshold moves, the dying twins it names early on the right layer against the healthy
runs it fires on, and its median lead over the twin's death."""

from __future__ import annotations

from pathlib import Path

from megatron_gnmr.experiments.detectors import FAMILIES


def _number(value, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(result: dict, rows) -> str:
    cases = result["cases"]
    dying = [s for s, c in cases.items() if c["died_at"] is not None]
    lines = [
        f"Seeds {', '.join(map(str, result['seeds']))}: {len(dying)} twins died, "
        f"{len(cases) - len(dying)} lived; harm margin {result['harm_margin']:.4f} (twice the "
        "healthy runs' seed-to-seed SD of the final loss).", "",
        "| seed | faulted layers | twin died at | onset of harm | CPU |", "|---|---|---|---|---|",
        *(f"| {seed} | {', '.join(map(str, c['fault_layers']))} | {_number(c['died_at'])} | "
          f"{_number(c['onset'])} | {c['cpu']} |" for seed, c in cases.items()), "",
        "Per setting: dying twins alarmed early (before the onset of harm) naming only faulted "
        "layers; before death; naming only faulted layers (at any time); median lead of the "
        "first recovery over the onset and over death (steps); healthy runs it fires on, and "
        "the median step of its first false alarm; twins that lived and it fired on.", "",
        "| setting | early + right | before death | right layer | lead over onset | "
        "lead over death | healthy fired | first false alarm | lived fired |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.label} | {r.early_and_right}/{r.dying} | {r.before_death}/{r.dying} | "
            f"{r.right_layer}/{r.dying} | {_number(r.lead_over_onset)} | "
            f"{_number(r.lead_over_death)} | {r.healthy_fired}/{r.healthy} | "
            f"{_number(r.first_false_alarm)} | {r.lived_fired}/{r.lived} |")
    spent = result.get("chosen_spend_on_dying")
    lines += ["", f"Chosen (no healthy run fired; most early and right; then longest lead): "
              f"**{result['chosen']}**"
              + (f", spending {spent:.1%} of the core attentions' unit-steps on the dying "
                 "twins (replayed)" if spent is not None else "")
              + ". Transformer Engine's rule at its tuned thresholds "
              f"(underflow %/MSE; its best that fires on no healthy run): "
              f"**{result['te_tuned']}**."]
    return "\n".join(lines) + "\n"


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for family in FAMILIES:
        mine = [r for r in rows if r.family == family.name]
        if not mine:
            continue
        fired = [r.healthy_fired / r.healthy for r in mine]
        early = [r.early_and_right / r.dying if r.dying else 0.0 for r in mine]
        points = left.scatter(fired, early, alpha=0.6, label=f"{family.name}: {family.text}")
        color = points.get_facecolor()[0]
        # the family's frontier: the most it names early for each share of healthy runs
        front, best = [], -1.0
        for x, y in sorted(zip(fired, early), key=lambda p: (p[0], -p[1])):
            if y > best:
                front.append((x, y))
                best = y
        left.plot(*zip(*front), "-", color=color, alpha=0.8)
        leads = [(f, r.lead_over_death) for f, r in zip(fired, mine)
                 if r.lead_over_death is not None]
        if leads:
            right.scatter(*zip(*leads), color=color, alpha=0.6)
    left.set(xlabel="healthy runs fired on (share)",
             ylabel="dying twins named early, right layer (share)",
             title="early and specific, as each threshold moves", xlim=(-0.05, 1.05),
             ylim=(-0.05, 1.05))
    right.set(xlabel="healthy runs fired on (share)",
              ylabel="median lead of the first recovery over death (steps)",
              title="how early", xlim=(-0.05, 1.05))
    figure.legend(loc="lower center", ncol=2, fontsize=7, frameon=False)
    figure.tight_layout(rect=(0, 0.16, 1, 1))
    figure.savefig(path, dpi=100)
    plt.close(figure)


def write_report(result: dict, rows, stem: Path) -> None:
    stem.with_suffix(".md").write_text(table(result, rows))
    plot(rows, stem.with_suffix(".png"))
