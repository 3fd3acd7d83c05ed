"""The fault ladder's held-out round, judged once (issue 56), from the committed summaries and
traces (`judge_round`, which writes DIR/held_out.json; the command, `megatron-gnmr
compare-ladder-held-out SCENARIO`, and its report are `ladder_held_out_report`).

The scenario (written by `ladder_held_out.py` from the training round's choice) runs per seed,
for each rung that kills, the twin and, where it died, every arm (`ARM@RUNG`); the twins of
`ladder_held_out.SECONDARY` alone, every arm's rule replayed on them (`secondary`); and `healthy`,
`exact-attention` and, where an arm's replay fires on the healthy trace, `healthy-ARM`. A
held-out seed feeds nothing: the harm margins are the training round's (docs/runs/
attention_ladder/ladder.json), both of them. Per rung and arm, over the seeds whose twin died:
- saved unharmed: the arm's run did not diverge and ended within the margin of exact attention
  of its seed (final loss: mean of the last 300 steps);
- its spend: the attention FLOPs it ran exact, plus the kernel probe's FLOPs on the unit-steps
  it left on the low path (for an arm that reads the probe);
- on the healthy run: whether its replay fires, and what the live run then spent.
Each rival against the chosen arm: the paired sign test over the seeds both ran (McNemar's
exact form, one-sided each way) beside Fisher's exact test, at both margins, on failures and
on healthy runs acted on; and the issue's goal per rung.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from megatron_gnmr.experiments import detection_traces
from megatron_gnmr.experiments.closed_loop_runs import run_summary
from megatron_gnmr.experiments.closed_loop_statistics import (
    fisher_one_sided,
    sign_test_one_sided,
)
from megatron_gnmr.experiments.held_out import fires_on, first_recovery
from megatron_gnmr.experiments.ladder import EXACT, HEALTHY, TWIN_PREFIX
from megatron_gnmr.experiments.run_summaries import collect, locations
from megatron_gnmr.precision.attention_fault import layer_of

CHOSEN = "chosen"
GOAL = {"saved": 14, "healthy_acted": 1, "probe_share": 0.02, "p": 0.05}  # of 16 seeds


def arms_and_rungs(scenario) -> tuple[list[str], list[str]]:
    pairs = [v.split("@") for v in scenario.variants if "@" in v]
    return list(dict.fromkeys(a for a, _ in pairs)), list(dict.fromkeys(r for _, r in pairs))


def verdicts(scenario, table: dict, traces: dict, margins: dict, probe_share: float) -> dict:
    """{rung: {arm: {seed: verdict}}}, each seed whose twin has run."""
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
            per_seed = {}
            for seed, twin in sorted(twins.items()):
                run = runs.get(seed)
                other_cpu = run is not None and not one_cpu(twin, exact.get(seed), run)
                if other_cpu:
                    run = None  # paired only on one CPU model: present, never judged
                gap = None if run is None or run["diverged_at"] is not None or \
                    seed not in exact else run["final_train_loss"] - exact[seed]["final_train_loss"]
                healthy = traces.get((HEALTHY, seed))
                fires = None if healthy is None else \
                    fires_on(healthy.trace, scenario, f"{arm}@{rung}", seed)
                recovered = run["recovered_share_of_executed_steps"] if run else None
                verdict = {
                    "twin_died_at": twin["diverged_at"], "ran": run is not None,
                    "other_cpu": other_cpu,
                    "diverged": run is not None and run["diverged_at"] is not None, "gap": gap,
                    "recovered": recovered,
                    "probe": None if recovered is None else
                    (1.0 - recovered) * probe_share * reads_probe,
                    "first_recovery": run["first_recovery"] if run else None,
                    "healthy_fires_at": fires,
                    "healthy_spent": 0.0 if fires is None else
                    (alone[seed]["recovered_share_of_executed_steps"] if seed in alone else None)}
                verdict["judged"] = verdict["ran"] and (verdict["diverged"] or seed in exact)
                for name, margin in margins.items():
                    verdict[f"failed_at_{name}"] = verdict["judged"] and (verdict["diverged"] or (
                        gap is not None and gap > margin))
                per_seed[seed] = verdict
            out[rung][arm] = per_seed
    return out


def one_cpu(*runs) -> bool:
    """Whether the runs given (None: absent) were made on one CPU model: a twin, its exact
    attention and an arm pair only there (GEMMs round differently across models)."""
    return len({r.get("cpu") for r in runs if r is not None}) <= 1


def secondary(scenario, table: dict, traces: dict) -> dict:
    """{rung: {arm: {seed: replay}}} for each twin without arms (`ladder_held_out.SECONDARY`):
    where each arm's rule, replayed on the twin's trace, would first recover, whether that
    recovery names a faulted layer, and the twin's final-loss gap to exact attention."""
    arms, rungs = arms_and_rungs(scenario)
    exact = table.get(EXACT, {})
    out = {}
    for variant in scenario.variants:
        rung = variant[len(TWIN_PREFIX):]
        if not variant.startswith(TWIN_PREFIX) or rung in rungs:
            continue
        out[rung] = {}
        for arm in arms:
            rule = f"{HEALTHY}-{arm}"  # the arm's flags on no fault: only its rule is read
            per_seed = {}
            for seed, twin in sorted(table.get(variant, {}).items()):
                loaded = traces.get((variant, seed))
                if loaded is None or not one_cpu(twin, exact.get(seed)):
                    continue
                step, units = first_recovery(loaded.trace, scenario, rule, seed)
                layers = {layer_of(loaded.trace.units[u]) for u in units}
                per_seed[seed] = {
                    "fires_at": step, "layers": sorted(layers),
                    "names_faulted": bool(layers & set(loaded.fault_layers)) if units else None,
                    "twin_died_at": twin["diverged_at"],
                    "gap": None if twin["diverged_at"] is not None or seed not in exact else
                    twin["final_train_loss"] - exact[seed]["final_train_loss"]}
            out[rung][arm] = per_seed
    return out


def complete(scenario, table: dict, traces: dict, judged: dict) -> bool:
    """Every seed has its twins, exact attention and a healthy trace, and every arm has run on
    every seed whose twin died: until then no goal is met or missed. A run made on another CPU
    model is there (a rerun would be skipped) but never judged: it leaves its seed out of the
    arm's verdicts, and the report names it."""
    arms, rungs = arms_and_rungs(scenario)
    for seed in scenario.seeds:
        if seed not in table.get(EXACT, {}) or (HEALTHY, seed) not in traces:
            return False
        if any(seed not in table.get(TWIN_PREFIX + rung, {}) for rung in rungs):
            return False
    return all(v["ran"] or v["other_cpu"] for by_arm in judged.values()
               for per_seed in by_arm.values() for v in per_seed.values() if v["twin_died_at"])


def dying_seeds(per_seed: dict) -> dict:
    """The seeds whose twin died and whose arm's run can be judged."""
    return {s: v for s, v in per_seed.items() if v["twin_died_at"] and v["judged"]}


def comparisons(by_arm: dict, margins: dict) -> dict:
    """Each rival against the chosen arm, on the seeds both ran: failures at each margin and
    healthy runs acted on; paired (sign test) and unpaired (Fisher), one-sided each way."""
    chosen = by_arm[CHOSEN]
    out = {}
    for arm, per_seed in by_arm.items():
        if arm == CHOSEN:
            continue
        rows = {}
        keys = [f"failed_at_{name}" for name in margins] + ["healthy"]
        for key in keys:
            if key == "healthy":
                seeds = sorted(set(chosen) & set(per_seed))
                ours = {s: chosen[s]["healthy_fires_at"] is not None for s in seeds}
                theirs = {s: per_seed[s]["healthy_fires_at"] is not None for s in seeds}
            else:
                seeds = sorted(set(dying_seeds(chosen)) & set(dying_seeds(per_seed)))
                ours = {s: chosen[s][key] for s in seeds}
                theirs = {s: per_seed[s][key] for s in seeds}
            only_ours = sum(ours[s] and not theirs[s] for s in seeds)
            only_theirs = sum(theirs[s] and not ours[s] for s in seeds)
            a, b, n = sum(ours.values()), sum(theirs.values()), len(seeds)
            rows[key] = {"seeds": n, "chosen": a, "rival": b,
                         "sign_p_chosen_better": sign_test_one_sided(only_ours, only_theirs),
                         "sign_p_rival_better": sign_test_one_sided(only_theirs, only_ours),
                         "fisher_p_chosen_better": fisher_one_sided(a, n, b, n) if n else 1.0,
                         "fisher_p_rival_better": fisher_one_sided(b, n, a, n) if n else 1.0}
        out[arm] = rows
    return out


def goal(by_arm: dict, compared: dict, probe_share: float, rivals: list[str], *,
         whole: bool) -> dict:
    """The issue's goal on one rung: saved >= 14 of the dying runs (of 16 seeds), at most 1
    healthy run acted on, the probe within 2% of the attention's FLOPs, and against TE's best
    arm a paired p < 0.05 on failures (exact margin) and no worse on healthy runs. Not met
    while the round is not `whole` (`complete`): `met` is then None."""
    dying = dying_seeds(by_arm[CHOSEN])
    saved = sum(not v["failed_at_exact"] for v in dying.values())
    acted = sum(v["healthy_fires_at"] is not None for v in by_arm[CHOSEN].values())
    versus = {arm: compared[arm]["failed_at_exact"]["sign_p_chosen_better"] < GOAL["p"]
              and compared[arm]["healthy"]["chosen"] <= compared[arm]["healthy"]["rival"]
              for arm in rivals if arm in compared}
    return {"dying": len(dying), "saved": saved, "healthy_acted": acted,
            "probe_share": probe_share, "beats": versus,
            "met": None if not whole else
            saved >= GOAL["saved"] * len(dying) / 16 and acted <= GOAL["healthy_acted"]
            and probe_share <= GOAL["probe_share"] and bool(versus) and all(versus.values())}


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
    probe = training.get("probe_share", 0.0)
    judged = verdicts(scenario, table, traces, training["margins"], probe)
    rivals = [arm for arm in arms_and_rungs(scenario)[0] if arm.startswith("te")]
    whole = complete(scenario, table, traces, judged)
    result = {"margins": training["margins"], "complete": whole, "rungs": {},
              "secondary": secondary(scenario, table, traces)}
    for rung, by_arm in judged.items():
        compared = comparisons(by_arm, training["margins"])
        result["rungs"][rung] = {"arms": by_arm, "versus_chosen": compared,
                                 "goal": goal(by_arm, compared, probe, rivals, whole=whole)}
    result["cpus"] = sorted({r.get("cpu") or "?" for arm in table.values() for r in arm.values()})
    (summaries / "held_out.json").write_text(json.dumps(result, indent=1) + "\n")
    return result, summaries
