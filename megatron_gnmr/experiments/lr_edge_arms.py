"""The LR edge's controlled round (issue 56 item 5), written from committed results alone:
`python -m megatron_gnmr.experiments.lr_edge_arms docs/runs/attention_ladder/ladder.json
docs/runs/lr_edge/lr_edge.json lr_edge lr_edge_controller` writes
configs/scenarios/lr_edge_arms.yaml.

Where it runs (`failing_lrs`): from the full sweep's judged result (lr_edge), each LR where
FP8 fails and BF16 lives, up to one step below BF16's divergence edge. The goal asks for FP8's
edge with the controller within one LR step of BF16's, so these are the LRs an arm must hold
at; one at or above BF16's divergence edge could only show more than the goal asks.

What runs there, per seed of the sweep, on the controller round's testbed (lr_edge_controller:
the sweep's base with every arm tracing every detector's quantity on the core attentions):
BF16 and FP8 again (every arm pairs with them on one CPU model and one version of the code);
every core attention exact (the positive control: what holding all of them buys, 14% of the
units' GEMM FLOPs); and the ladder's arms under its one rule (`ladder_held_out.arms`: the chosen
detector, TE's rule latched, unlatched and allowed to see O, the first-layer rule, random:
two units drawn after the warm-up and kept), with GNMR at the project's alpha (2) where the
ladder's training round found no quiet GNMR setting: at most 2 units and latched as every
arm, with the lock, window and warm-up of the ladder's GNMR family. Nothing is tuned at
the edge: the settings are the ladder's, committed before this file wrote anything.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from megatron_gnmr.experiments.ladder_held_out import SCENARIO, arms, parse_label, setting_flags

POSITIVE_CONTROL = "attention-exact"
GNMR_AT_DEFAULTS = "gnmr-latch 2"


def failing_lrs(sweep_result: dict) -> list[str]:
    """The LRs (as the sweep's result spells them) below BF16's divergence edge where no BF16
    seed diverged and FP8 fails: a seed diverged, or FP8 is worse than BF16 on every paired
    seed and by more than the sweep's tolerance on average."""
    bf16, fp8 = sweep_result["arms"]["bf16"], sweep_result["arms"]["fp8"]
    out = []
    for lr, pair in sweep_result["paired"].items():
        if float(lr) >= bf16["divergence_edge"] or bf16["rows"][lr]["diverged"]:
            continue
        worse = pair["worse"] == pair["seeds"] > 0 and pair["mean_gap"] > sweep_result["tolerance"]
        if fp8["rows"][lr]["diverged"] or worse:
            out.append(lr)
    return sorted(out, key=float)


def controlled_arms(ladder: dict) -> dict[str, list[str]]:
    """The ladder's arms, with GNMR at the project's alpha (the ladder's GNMR family: at most 2
    units, latched) where the ladder chose none."""
    out = arms(ladder)
    out.setdefault("gnmr", setting_flags(parse_label(GNMR_AT_DEFAULTS)))
    return out


def write_scenario(ladder: dict, sweep_result: dict, sweep: dict, controller: dict,
                   path: Path) -> list[str]:
    """The scenario; returns the LRs it covers, spelled as the sweep's variants."""
    by_value = {float(name.split("-lr")[1]): name.split("-lr")[1]
                for name in sweep["variants"] if name.startswith("fp8-lr")}
    spelled = [by_value[float(lr)] for lr in failing_lrs(sweep_result)]
    control = next(flags for name, flags in controller["variants"].items()
                   if name.startswith(f"{POSITIVE_CONTROL}-lr"))
    control = control[control.index("--gnmr-max-o"):]  # its controller flags, not its LR
    variants = {}
    for lr in spelled:
        fp8 = sweep["variants"][f"fp8-lr{lr}"]
        variants[f"bf16-lr{lr}"] = sweep["variants"][f"bf16-lr{lr}"]
        variants[f"fp8-lr{lr}"] = fp8
        variants[f"{POSITIVE_CONTROL}-lr{lr}"] = [*fp8, *control]
        for arm, flags in controlled_arms(ladder).items():
            variants[f"{arm}-lr{lr}"] = [*fp8, *flags]
    description = (
        "Issue 56 item 5, the LR edge's controlled round, written by experiments/lr_edge_arms.py "
        "from docs/runs/attention_ladder/ladder.json, the full LR sweep's result "
        "(docs/runs/lr_edge/lr_edge.json) and the controller round's testbed before any of "
        f"these runs: at the LRs where FP8 fails and BF16 lives ({', '.join(spelled)}), up to "
        "one step below BF16's divergence edge, BF16 and FP8 again, every core attention exact "
        "(the positive control) and the ladder's arms on the core attentions at the settings "
        f"its training round chose (chosen: {ladder['chosen']}; GNMR: "
        f"{ladder['best'].get('gnmr-latch') or GNMR_AT_DEFAULTS + ', the project default'}; "
        "random: two units drawn after the warm-up and kept), at most 2 of the 4.")
    scenario = {"description": description, "base": controller["base"],
                "smoke": controller.get("smoke", []), "seeds": sweep["seeds"],
                "smoke_seeds": sweep.get("smoke_seeds", sweep["seeds"][:1]),
                "reference": f"bf16-lr{spelled[0]}", "variants": variants}
    path.write_text(yaml.safe_dump(scenario, sort_keys=False, width=100))
    return spelled


def main(argv: list[str]) -> None:
    if len(argv) != 4:
        sys.exit("usage: python -m megatron_gnmr.experiments.lr_edge_arms LADDER_JSON "
                 "SWEEP_JSON SWEEP_SCENARIO CONTROLLER_SCENARIO (e.g. "
                 "docs/runs/attention_ladder/ladder.json docs/runs/lr_edge/lr_edge.json "
                 "lr_edge lr_edge_controller)")
    ladder, sweep_result = (json.loads(Path(p).read_text()) for p in argv[:2])
    sweep, controller = (yaml.safe_load((SCENARIO / f"{name}.yaml").read_text())
                         for name in argv[2:])
    print(write_scenario(ladder, sweep_result, sweep, controller,
                         SCENARIO / "lr_edge_arms.yaml"))


if __name__ == "__main__":
    main(sys.argv[1:])
