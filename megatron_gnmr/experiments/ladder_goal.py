"""The issue's goal on one rung of the fault ladder's held-out round, and the tests behind it
(issue 56), read from `ladder_verdicts.verdicts`:
- the rung is judged only if its twins die on at least half the held-out seeds;
- saved unharmed: at least 14 of 16 of the dying runs (scaled to the twins that died), at each
  of the training round's two margins; a chosen run that cannot be judged (made on another
  CPU model, or missing) counts as not saved;
- at most 1 of 16 healthy runs acted on (the arm's rule, replayed on the healthy trace, fires);
- the probe's FLOPs at most 2% of the attention's, as measured on the round's healthy runs;
- against each of TE's arms run (stricter than "TE's best"): the paired sign test on failures,
  p < 0.05 at each margin, and no more spent on the healthy runs, where a healthy run's spend
  is the share of unit-steps run exact plus the probe's FLOPs on the rest (TE's metrics are
  counted at no cost, as in the training round).
"""

from __future__ import annotations

import statistics

from megatron_gnmr.experiments.closed_loop_statistics import (
    fisher_one_sided,
    sign_test_one_sided,
)

CHOSEN = "chosen"
GOAL = {"saved": 14, "healthy_acted": 1, "probe_share": 0.02, "p": 0.05}  # of 16 seeds


def goal_arms(arms) -> list[str]:
    """The arms the goal reads: the chosen one and TE's (its rivals)."""
    return [arm for arm in arms if arm == CHOSEN or arm.startswith("te")]


def dying_seeds(per_seed: dict) -> dict:
    """The seeds whose twin died and whose arm's run can be judged."""
    return {s: v for s, v in per_seed.items() if v["twin_died_at"] and v["judged"]}


def mean_healthy_spend(per_seed: dict, seeds) -> float | None:
    spends = [per_seed[s]["healthy_spend"] for s in seeds]
    return None if not spends or None in spends else statistics.fmean(spends)


def _tests(ours: dict, theirs: dict) -> dict:
    """Failures (or healthy runs acted on) of the chosen arm and a rival, seed for seed: the
    paired sign test and Fisher's, one-sided each way."""
    seeds = sorted(ours)
    only_ours = sum(ours[s] and not theirs[s] for s in seeds)
    only_theirs = sum(theirs[s] and not ours[s] for s in seeds)
    a, b, n = sum(ours.values()), sum(theirs.values()), len(seeds)
    return {"seeds": n, "chosen": a, "rival": b,
            "sign_p_chosen_better": sign_test_one_sided(only_ours, only_theirs),
            "sign_p_rival_better": sign_test_one_sided(only_theirs, only_ours),
            "fisher_p_chosen_better": fisher_one_sided(a, n, b, n) if n else 1.0,
            "fisher_p_rival_better": fisher_one_sided(b, n, a, n) if n else 1.0}


def comparisons(by_arm: dict, margins: dict) -> dict:
    """Each rival against the chosen arm: failures at each margin over the dying seeds both
    can be judged on; healthy runs acted on, and the mean healthy spend, over the seeds both
    have a healthy trace for."""
    chosen = by_arm[CHOSEN]
    out = {}
    for arm, per_seed in by_arm.items():
        if arm == CHOSEN:
            continue
        both = sorted(set(dying_seeds(chosen)) & set(dying_seeds(per_seed)))
        rows = {f"failed_at_{name}": _tests({s: chosen[s][f"failed_at_{name}"] for s in both},
                                            {s: per_seed[s][f"failed_at_{name}"] for s in both})
                for name in margins}
        healthy = sorted(s for s in chosen if chosen[s]["healthy_traced"]
                         and per_seed.get(s, {}).get("healthy_traced"))
        rows["healthy"] = _tests({s: chosen[s]["healthy_fires_at"] is not None for s in healthy},
                                 {s: per_seed[s]["healthy_fires_at"] is not None
                                  for s in healthy})
        rows["healthy_spend"] = {"seeds": len(healthy),
                                 "chosen": mean_healthy_spend(chosen, healthy),
                                 "rival": mean_healthy_spend(per_seed, healthy)}
        out[arm] = rows
    return out


def _beats(rows: dict, margins: dict) -> dict:
    spend = rows["healthy_spend"]
    return {**{f"failures at the {name} margin": rows[f"failed_at_{name}"][
        "sign_p_chosen_better"] < GOAL["p"] for name in margins},
        "healthy spend": spend["chosen"] is not None and spend["rival"] is not None
        and spend["chosen"] <= spend["rival"]}


def goal(by_arm: dict, compared: dict, probe_share: float | None, rivals: list[str],
         margins: dict, *, whole: bool) -> dict:
    """The goal on one rung (the module's docstring). `met` is None while the round is not
    `whole` (`ladder_verdicts.complete`) or the rung does not qualify (its twins died on fewer
    than half the seeds)."""
    chosen = by_arm[CHOSEN]
    died = [v for v in chosen.values() if v["twin_died_at"]]
    qualifies = len(chosen) > 0 and 2 * len(died) >= len(chosen)
    saved = {name: sum(v["judged"] and not v[f"failed_at_{name}"] for v in died)
             for name in margins}
    acted = sum(v["healthy_fires_at"] is not None for v in chosen.values())
    beats = {arm: _beats(compared[arm], margins) for arm in rivals if arm in compared}
    need = GOAL["saved"] * len(died) / 16
    met = None if not (whole and qualifies) else (
        all(count >= need for count in saved.values()) and acted <= GOAL["healthy_acted"]
        and probe_share is not None and probe_share <= GOAL["probe_share"]
        and bool(beats) and all(all(tests.values()) for tests in beats.values()))
    return {"seeds": len(chosen), "died": len(died), "qualifies": qualifies, "saved": saved,
            "healthy_acted": acted, "healthy_spend": mean_healthy_spend(chosen, list(chosen)),
            "probe_share": probe_share, "beats": beats, "met": met}
