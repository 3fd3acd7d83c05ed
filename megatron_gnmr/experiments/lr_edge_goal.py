"""The LR edge's goal (issue 56 item 5), as results.md section 14 declared it before the
controlled round (lr_edge_arms) ran, judged from `lr_edge.judge`'s result of that round and
of the full sweep it was chosen from:
- an arm *holds* at an LR when every seed of the round paired with BF16 (same seed, one CPU
  model, BF16 not diverged), none diverged, and its mean gap to BF16 is at most the sweep's
  tolerance; a seed missing, made on another CPU model or beside a BF16 run that diverged
  counts against holding;
- its *edge*: the largest LR up to which it holds at every LR, the sweep's LRs below the
  round's counting as held where FP8 held there in the sweep;
- BF16's edge: its divergence edge in the sweep;
- the goal: an arm whose edge is within one LR step of BF16's (it holds at every LR of the
  round), at most 15% of the units' GEMM FLOPs run exact, the kernel probe's FLOPs included;
  judged once every run of the round is in. Every core attention exact, the positive control,
  is reported beside the arms and not judged: it is a static choice that fits the budget
  (14% of the units' GEMM FLOPs), not a controller.
With three seeds no paired test reaches p < 0.05; the sign test against FP8 is reported.
"""

from __future__ import annotations

import statistics

from megatron_gnmr.experiments.closed_loop_statistics import sign_test_one_sided

FLOP_BUDGET = 0.15
REFERENCES = ("bf16", "fp8")
POSITIVE_CONTROL = "attention-exact"  # reported, not judged


def _holds(row: dict | None, seeds: list[int], tolerance: float) -> bool:
    return row is not None and row["seeds"] == len(seeds) and not row["diverged_seeds"] and \
        row["mean_gap"] <= tolerance


def per_lr(result: dict, table: dict, arm: str, lr: float, seeds: list[int],
           probe_share: float | None, attention_share: float | None) -> dict | None:
    """The arm at one LR: paired gaps to BF16 and FP8, the sign test against FP8, its GEMM
    FLOPs run exact (plus the probe's), and per seed where it first recovered and which
    layers it held."""
    rows = result["arms"]
    if lr not in rows[arm]["rows"] or lr not in rows["bf16"]["rows"]:
        return None
    mine, bf16 = rows[arm]["rows"][lr], rows["bf16"]["rows"][lr]
    fp8 = rows["fp8"]["rows"].get(lr) if "fp8" in rows else None
    # a BF16 run that diverged counts its initial loss: a gap to it says nothing
    paired = [s for s in seeds if s in mine["final"] and s in bf16["final"]
              and s not in bf16["diverged"] and mine["cpu"].get(s) == bf16["cpu"].get(s)]
    gaps = {s: mine["final"][s] - bf16["final"][s] for s in paired}
    against_fp8 = [s for s in paired if fp8 is not None and s in fp8["final"]
                   and fp8["cpu"].get(s) == mine["cpu"].get(s)]
    worse = sum(mine["final"][s] > fp8["final"][s] for s in against_fp8)
    better = sum(mine["final"][s] < fp8["final"][s] for s in against_fp8)
    runs = table.get(arm, {}).get(lr, {})
    flops = [r.get("recovered_gemm_flop_share") for r in runs.values()]
    flop_share = None if not flops or None in flops else statistics.fmean(flops)
    return {"seeds": len(paired), "gaps": gaps,
            "mean_gap": statistics.fmean(gaps.values()) if gaps else None,
            "diverged_seeds": mine["diverged"],
            "better_than_fp8": better, "versus_fp8_seeds": len(against_fp8),
            "sign_p_better_than_fp8": sign_test_one_sided(worse, better),
            "gemm_flops": _with_probe(flop_share, runs, probe_share, attention_share),
            "first_recovery": {s: r.get("first_recovery") for s, r in sorted(runs.items())},
            "layers": {s: _layers(r) for s, r in sorted(runs.items())}}


def _layers(run: dict) -> list[int]:
    return sorted({int(unit.split("layers.")[1].split(".")[0])
                   for unit in run.get("recoveries", {}) if "layers." in unit})


def _with_probe(flop_share: float | None, runs: dict, probe_share: float | None,
                attention_share: float | None) -> float | None:
    """The units' GEMM FLOPs run exact plus the probe's on the attention left on the low
    path: the probe's share of the attention's FLOPs times the attention's share of the
    units' GEMM FLOPs (`attention_share`)."""
    if flop_share is None:
        return None
    if not any(_decides_on_probe(r.get("command", [])) for r in runs.values()):
        return flop_share
    if probe_share is None or attention_share is None:
        return None
    unit_share = statistics.fmean(r["recovered_share_of_executed_steps"] for r in runs.values())
    return flop_share + probe_share * attention_share * (1.0 - unit_share)


def attention_gemm_share(table: dict) -> float | None:
    """The core attentions' share of the units' GEMM FLOPs, from any run that recovered some:
    its GEMM share over its unit-step share (every unit a core attention of one cost)."""
    ratios = [r["recovered_gemm_flop_share"] / r["recovered_share_of_executed_steps"]
              for by_lr in table.values() for runs in by_lr.values() for r in runs.values()
              if r.get("recovered_share_of_executed_steps")
              and r.get("recovered_gemm_flop_share") is not None]
    return statistics.median(ratios) if ratios else None


def _decides_on_probe(command: list) -> bool:
    """Whether the run's controller decides on the kernel probe (every arm of the round
    measures it, to be replayed; only one reading it pays for it): its last --gnmr-signals."""
    flags = [str(flag) for flag in command]
    signals = [flags[i + 1] for i, flag in enumerate(flags[:-1]) if flag == "--gnmr-signals"]
    return bool(signals) and signals[-1].startswith("kernel_")


def judge_goal(result: dict, table: dict, sweep: dict, seeds: list[int],
               probe_share: float | None, complete: bool) -> dict:
    """{arm: verdict} for each arm of the round but BF16, FP8 and the positive control (whose
    rows are reported, `met` None), and BF16's edge. `table`: {arm: {lr: {seed: summary}}};
    `sweep`: the full sweep's judged result (keys as committed, strings). `met` is None until
    the round is `complete`."""
    tolerance = sweep["tolerance"]
    bf16_edge = sweep["arms"]["bf16"]["divergence_edge"]
    round_lrs = sorted(result["arms"]["bf16"]["rows"]) if "bf16" in result["arms"] else []
    grid = sorted({*round_lrs, *(float(lr) for lr in sweep["paired"])})
    held_below = [lr for lr in grid if round_lrs and lr < min(round_lrs)
                  and _sweep_fp8_holds(sweep, lr, tolerance)]
    target = max((lr for lr in grid if lr < bf16_edge), default=None)
    attention = attention_gemm_share(table)
    out = {"bf16_edge": bf16_edge, "target_edge": target, "tolerance": tolerance,
           "probe_share": probe_share, "attention_gemm_share": attention, "arms": {}}
    for arm in result["arms"]:
        if arm in REFERENCES:
            continue
        rows = {lr: per_lr(result, table, arm, lr, seeds, probe_share, attention)
                for lr in round_lrs}
        held = {lr: _holds(row, seeds, tolerance) for lr, row in rows.items()}
        edge = None
        for lr in grid:
            if held.get(lr) or lr not in held and lr in held_below:
                edge = lr
            else:
                break
        flops = [row["gemm_flops"] for row in rows.values() if row is not None]
        spend = None if not flops or None in flops or len(flops) < len(rows) else max(flops)
        judged = complete and arm != POSITIVE_CONTROL and target is not None
        out["arms"][arm] = {
            "rows": rows, "holds": held, "edge": edge, "gemm_flops": spend,
            "met": None if not judged else edge is not None and edge >= target
            and spend is not None and spend <= FLOP_BUDGET}
    return out


def _sweep_fp8_holds(sweep: dict, lr: float, tolerance: float) -> bool:
    key = next(k for k in sweep["paired"] if float(k) == lr)
    pair, fp8 = sweep["paired"][key], sweep["arms"]["fp8"]["rows"][key]
    return not fp8["diverged"] and pair["seeds"] > 0 and pair["mean_gap"] <= tolerance


def lines(goal: dict, complete: bool) -> list[str]:
    target = "-" if goal["target_edge"] is None else f"{goal['target_edge']:g}"
    out = ["", "## The goal: FP8's edge with the controller within one LR step of BF16's", "",
           f"BF16's divergence edge in the sweep: {goal['bf16_edge']:g}, so an arm must hold "
           f"up to {target}: at each LR every seed paired with BF16, none diverged, mean gap to "
           f"BF16 at most {goal['tolerance']}; at most {FLOP_BUDGET:.0%} of the GEMM FLOPs run "
           "exact (the probe's included; the units' GEMMs). Every core attention exact is the "
           "positive control, reported and not judged. Sign test against FP8: p that the arm "
           "is better, seed for seed (three seeds: at best 0.125).", "",
           "| arm | LR | gaps to BF16 | mean | holds | better than FP8 (p) | GEMM FLOPs exact | "
           "first recovery, layers held, per seed |", "|---|---|---|---|---|---|---|---|"]
    for arm, verdict in goal["arms"].items():
        for lr, row in verdict["rows"].items():
            if row is None:
                out.append(f"| {arm} | {lr:g} | not run | - | no | - | - | - |")
                continue
            gaps = ", ".join(f"{g:+.3f}" for g in row["gaps"].values()) or "-"
            mean = "-" if row["mean_gap"] is None else f"{row['mean_gap']:+.3f}"
            flops = "-" if row["gemm_flops"] is None else f"{row['gemm_flops']:.1%}"
            seen = "; ".join(f"{s}: {row['first_recovery'][s] or 'never'}"
                             f"{' ' + str(row['layers'][s]) if row['layers'][s] else ''}"
                             for s in row["first_recovery"]) or "-"
            out.append(f"| {arm} | {lr:g} | {gaps} | {mean} | "
                       f"{'yes' if verdict['holds'][lr] else 'no'} | "
                       f"{row['better_than_fp8']}/{row['versus_fp8_seeds']} "
                       f"({row['sign_p_better_than_fp8']:.3g}) | {flops} | {seen} |")
    out.append("")
    if not complete:
        out.append("**The round is not complete**: no goal is met or missed yet.")
        return out
    for arm, verdict in goal["arms"].items():
        if verdict["met"] is None:
            continue  # the positive control: reported above, not judged
        edge = "below the grid" if verdict["edge"] is None else f"{verdict['edge']:g}"
        flops = "unknown" if verdict["gemm_flops"] is None else f"{verdict['gemm_flops']:.1%}"
        out.append(f"- {arm}: edge {edge}, GEMM FLOPs exact at most {flops}: "
                   f"**{'met' if verdict['met'] else 'not met'}**.")
    return out


def judge_round(result: dict, by_arm: dict, scenario, table: dict, summaries, sweep_path,
                traced_arm: str) -> tuple[dict, bool]:
    """The goal from `compare-lr-edge`'s result and its runs ({arm: {lr: {seed: summary}}};
    `table`: {variant: {seed: summary}}), the probe's cost measured on the round's traces of
    its uncontrolled FP8 arm, and whether every run is in."""
    import json

    from megatron_gnmr.experiments import detection_traces

    probe_share = detection_traces.mean_probe_cost(
        [detection_traces.read(path)
         for path in sorted((summaries / "traces").glob(f"{traced_arm}-lr*-seed*.npz"))])
    complete = all(seed in table.get(variant, {})
                   for variant, seed, _ in scenario.runs(smoke=False))
    goal = judge_goal(result, by_arm, json.loads(sweep_path.read_text()), list(scenario.seeds),
                      probe_share, complete)
    return goal, complete
