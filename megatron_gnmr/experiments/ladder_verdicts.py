"""The fault ladder's held-out round, judged once (issue 56), from the committed summaries and
traces (`judge_round`, which writes DIR/held_out.json; the goal and its tests are
`ladder_goal`; the command, `megatron-gnmr compare-ladder-held-out SCENARIO`, and its report
are `ladder_held_out_report`).

The scenario (written by `ladder_held_out.py` from the training round's choice) runs per seed,
for each rung that kills, the twin and, where it died, every arm (`ARM@RUNG`); the twins of
`ladder_held_out.SECONDARY` alone, every arm's rule replayed on them (`secondary`, which also
replays them on a killing rung's twins that lived); and `healthy`, `exact-attention` and,
where an arm's replay fires on the healthy trace, `healthy-ARM`. A held-out seed feeds
nothing: the harm margins are the training round's (docs/runs/attention_ladder/ladder.json),
both of them; the probe's cost is measured on the round's own healthy runs. Per rung, arm and
seed whose twin has run:
- saved unharmed: the arm's run did not diverge and ended within the margin of exact attention
  of its seed (final loss: mean of the last 300 steps), judged only where exact attention
  lived and the twin, exact attention and the arm ran on one CPU model;
- its spend: the share of the core attentions' unit-steps it ran exact, plus the kernel
  probe's FLOPs on the unit-steps it left on the low path (for an arm that reads the probe);
- on the healthy run: whether its replay fires, what it spends (the live `healthy-ARM` run's
  exact share where it fires, plus the probe), and the live run's first recovery beside the
  replay's step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_gnmr.experiments import detection_traces
from megatron_gnmr.experiments.closed_loop_runs import run_summary
from megatron_gnmr.experiments.committed_runs import superseded_seeds
from megatron_gnmr.experiments.held_out import fires_on, first_recovery
from megatron_gnmr.experiments.ladder import EXACT, HEALTHY, TWIN_PREFIX
from megatron_gnmr.experiments.ladder_goal import CHOSEN, comparisons, goal, goal_arms
from megatron_gnmr.experiments.run_summaries import collect, locations
from megatron_gnmr.precision.attention_fault import layer_of


def arms_and_rungs(scenario) -> tuple[list[str], list[str]]:
    pairs = [v.split("@") for v in scenario.variants if "@" in v]
    return list(dict.fromkeys(a for a, _ in pairs)), list(dict.fromkeys(r for _, r in pairs))


def verdicts(scenario, table: dict, traces: dict, margins: dict, probe_share: float | None
             ) -> dict:
    """{rung: {arm: {seed: verdict}}}, each seed whose twin has run. `probe_share`: the kernel
    probe's FLOPs over the attention's, measured on the round's healthy traces."""
    arms, rungs = arms_and_rungs(scenario)
    exact = table.get(EXACT, {})
    out = {}
    for rung in rungs:
        twins = table.get(TWIN_PREFIX + rung, {})
        out[rung] = {}
        for arm in arms:
            runs, alone = table.get(f"{arm}@{rung}", {}), table.get(f"{HEALTHY}-{arm}", {})
            reads_probe = any(flag.startswith("kernel_")
                              for flag in scenario.variants[f"{arm}@{rung}"])
            probe = None if probe_share is None else probe_share * reads_probe
            out[rung][arm] = {seed: _verdict(
                twin, runs.get(seed), exact.get(seed), traces.get((HEALTHY, seed)),
                alone.get(seed), margins, probe,
                lambda trace: fires_on(trace, scenario, f"{arm}@{rung}", seed))
                for seed, twin in sorted(twins.items())}
    return out


def _verdict(twin: dict, run: dict | None, reference: dict | None, healthy, alone: dict | None,
             margins: dict, probe: float | None, fires) -> dict:
    """One arm's run on one seed (None: not run), judged against exact attention of the seed
    (`reference`), and the arm's rule on the seed's healthy trace and live healthy run."""
    other_cpu = run is not None and not one_cpu(twin, reference, run)
    if other_cpu:
        run = None  # paired only on one CPU model: present, never judged
    usable = reference is not None and reference["diverged_at"] is None
    diverged = run is not None and run["diverged_at"] is not None
    gap = run["final_train_loss"] - reference["final_train_loss"] \
        if run is not None and not diverged and usable else None
    recovered = run["recovered_share_of_executed_steps"] if run else None
    fires_at = None if healthy is None else fires(healthy.trace)
    verdict = {
        "twin_died_at": twin["diverged_at"], "ran": run is not None, "other_cpu": other_cpu,
        "diverged": diverged, "gap": gap, "recovered": recovered,
        "probe": None if recovered is None or probe is None else (1.0 - recovered) * probe,
        "first_recovery": run["first_recovery"] if run else None,
        "healthy_traced": healthy is not None, "healthy_fires_at": fires_at,
        # a live healthy run is made only where the replay fires; elsewhere it would be the
        # healthy run, bit for bit, with nothing recovered
        "healthy_live_ran": alone is not None,
        "healthy_live_first_recovery": alone["first_recovery"] if alone else None,
        "healthy_spend": _healthy_spend(healthy, fires_at, alone, probe),
        "judged": run is not None and (diverged or usable)}
    for name, margin in margins.items():
        verdict[f"failed_at_{name}"] = verdict["judged"] and (diverged or gap > margin)
    return verdict


def _healthy_spend(healthy, fires_at: int | None, alone: dict | None, probe: float | None
                   ) -> float | None:
    """What the arm spends on the healthy run: the share of unit-steps it runs exact plus the
    probe's FLOPs on the rest (None: not known yet)."""
    if healthy is None or probe is None:
        return None
    if fires_at is None:
        return probe
    if alone is None:
        return None  # its live healthy run has not run
    recovered = alone["recovered_share_of_executed_steps"]
    return recovered + (1.0 - recovered) * probe


def one_cpu(*runs) -> bool:
    """Whether the runs given (None: absent) were made on one CPU model: a twin, its exact
    attention and an arm pair only there (GEMMs round differently across models)."""
    return len({r.get("cpu") for r in runs if r is not None}) <= 1


def secondary(scenario, table: dict, traces: dict) -> dict:
    """{rung: {arm: {seed: replay}}} for each twin no arm ran beside: those of
    `ladder_held_out.SECONDARY`, and a killing rung's twins that lived (as "RUNG, lived"): where
    each arm's rule, replayed on the twin's trace, would first recover, whether that recovery
    names a faulted layer, and the twin's final-loss gap to exact attention (None: died, or
    exact attention ran on another CPU model)."""
    arms, rungs = arms_and_rungs(scenario)
    exact = table.get(EXACT, {})
    out = {}
    for variant in scenario.variants:
        if not variant.startswith(TWIN_PREFIX):
            continue
        rung = variant[len(TWIN_PREFIX):]
        twins = table.get(variant, {})
        if rung in rungs:
            rung, twins = f"{rung}, lived", {s: t for s, t in twins.items()
                                            if t["diverged_at"] is None}
        out[rung] = {}
        for arm in arms:
            rule = f"{HEALTHY}-{arm}"  # the arm's flags on no fault: only its rule is read
            per_seed = {}
            for seed, twin in sorted(twins.items()):
                loaded = traces.get((variant, seed))
                if loaded is None:
                    continue
                step, units = first_recovery(loaded.trace, scenario, rule, seed)
                layers = {layer_of(loaded.trace.units[u]) for u in units}
                paired = seed in exact and one_cpu(twin, exact[seed])
                per_seed[seed] = {
                    "fires_at": step, "layers": sorted(layers),
                    "names_faulted": bool(layers & set(loaded.fault_layers)) if units else None,
                    "twin_died_at": twin["diverged_at"],
                    "gap": None if twin["diverged_at"] is not None or not paired else
                    twin["final_train_loss"] - exact[seed]["final_train_loss"]}
            out[rung][arm] = per_seed
    return out


def complete(scenario, table: dict, traces: dict, judged: dict) -> bool:
    """Every seed has the twins of the rungs with arms, exact attention and a healthy trace;
    each arm the goal reads (`ladder_goal.goal_arms`) has run on every seed whose twin died,
    and on the healthy run wherever its replay fires: until then no goal is met or missed.
    The arms the goal does not read and the twins run alone are not waited for
    (`arms_complete` and `secondary_complete` mark their tables). A run made on another CPU
    model is there (a rerun would be skipped) but never judged: the chosen arm's counts as not
    saved, a rival's leaves its seed out of the paired tests, and the report names it."""
    arms, rungs = arms_and_rungs(scenario)
    for seed in scenario.seeds:
        if seed not in table.get(EXACT, {}) or (HEALTHY, seed) not in traces:
            return False
        if any(seed not in table.get(TWIN_PREFIX + rung, {}) for rung in rungs):
            return False
    return arms_complete(judged, goal_arms(arms))


def arms_complete(judged: dict, arms) -> bool:
    """Each of `arms` has run on every seed whose twin died, and on the healthy run wherever
    its replay fires."""
    verdicts_ = [v for by_arm in judged.values() for arm, per_seed in by_arm.items()
                 if arm in arms for v in per_seed.values()]
    return all(v["ran"] or v["other_cpu"] for v in verdicts_ if v["twin_died_at"]) and \
        all(v["healthy_spend"] is not None for v in verdicts_)


def secondary_complete(scenario, table: dict) -> bool:
    """Every twin without arms has run on every seed."""
    _, rungs = arms_and_rungs(scenario)
    return all(seed in table.get(variant, {}) for variant in scenario.variants
               if variant.startswith(TWIN_PREFIX) and variant[len(TWIN_PREFIX):] not in rungs
               for seed in scenario.seeds)


def judge_round(args: argparse.Namespace) -> tuple[dict, Path]:
    """The round's result (also written to SUMMARIES/held_out.json) and SUMMARIES."""
    from megatron_gnmr.experiments.ladder import collect_traces

    scenario, runs, summaries = locations(args)
    table = collect(scenario, runs, summaries, run_summary)
    if runs.is_dir():
        collect_traces(scenario, runs, summaries / "traces")
    traces = {}
    for path in sorted((summaries / "traces").glob("*.npz")):
        variant, _, seed = path.stem.rpartition("-seed")
        traces[variant, int(seed)] = detection_traces.read(path)
    training = json.loads(Path(args.training).read_text())
    probe = measured_probe_share(traces)
    judged = verdicts(scenario, table, traces, training["margins"], probe)
    arms = arms_and_rungs(scenario)[0]
    rivals = [arm for arm in goal_arms(arms) if arm != CHOSEN]
    whole = complete(scenario, table, traces, judged)
    result = {"margins": training["margins"], "complete": whole, "probe_share": probe,
              "arms_complete": arms_complete(judged, arms),
              "secondary_complete": secondary_complete(scenario, table),
              "rungs": {}, "secondary": secondary(scenario, table, traces)}
    for rung, by_arm in judged.items():
        compared = comparisons(by_arm, training["margins"])
        result["rungs"][rung] = {
            "arms": by_arm, "versus_chosen": compared,
            "goal": goal(by_arm, compared, probe, rivals, training["margins"], whole=whole)}
    result["cpus"] = sorted({r.get("cpu") or "?" for arm in table.values() for r in arm.values()})
    result["superseded"] = superseded_seeds(summaries)
    (summaries / "held_out.json").write_text(json.dumps(result, indent=1) + "\n")
    return result, summaries


def measured_probe_share(traces: dict) -> float | None:
    """The kernel probe's FLOPs over the attention's, the mean over the round's healthy traces
    (every unit-step of a healthy run is probed); None where none measured it."""
    return detection_traces.mean_probe_cost(
        [loaded for (variant, _), loaded in sorted(traces.items()) if variant == HEALTHY])
