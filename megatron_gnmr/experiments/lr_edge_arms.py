"""The LR edge's controlled round (issue 56 item 5), written from two committed results and
the scenario the second judged:
`python -m megatron_gnmr.experiments.lr_edge_arms docs/runs/attention_ladder/ladder.json
docs/runs/lr_edge_controller/lr_edge.json lr_edge_controller` writes
configs/scenarios/lr_edge_arms.yaml.

The round is the controller's (lr_edge_controller: 0.048 and 0.096, its FP8 runs traced with
every detector's quantity, on which `compare-lr-edge --traced-arm fp8` replays the ladder's
choice), not the first sweep's: the replay says what each arm would do there, and the arms
pair with BF16 on the controller round's testbed. Where FP8 fails and BF16 lives
(`failing_lrs`), per seed: BF16 and FP8 again (so that every arm pairs with them on one CPU
model and one version of the code), and the
ladder's arms (`ladder_held_out.arms`: the chosen detector, TE's rule with and without the
latch and allowed to see O, GNMR, the first-layer rule, random: two units drawn and kept), each on
the core attentions, under the ladder's one rule. Nothing here is tuned at the edge: the
settings are the ladder's training round's, committed before this file exists.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from megatron_gnmr.experiments.ladder_held_out import SCENARIO, arms

TRACED = ("kernel_output_bias,kernel_delta_bias,kernel_delta_error,kernel_probe_cost,"
          "fp8_underflow,fp8_mse,fp8_underflow_o,fp8_mse_o")


def failing_lrs(lr_edge: dict) -> list[str]:
    """The LRs where FP8 fails and BF16 lives: no BF16 seed diverged, FP8 worse than BF16 on
    every seed, and by more than the sweep's tolerance on average (the LR has cost FP8 what it
    has not cost BF16)."""
    bf16 = lr_edge["arms"]["bf16"]["rows"]
    return [lr for lr, pair in lr_edge["paired"].items()
            if not bf16[lr]["diverged"] and pair["worse"] == pair["seeds"] > 0
            and pair["mean_gap"] > lr_edge["tolerance"]]


def write_scenario(ladder: dict, lr_edge: dict, sweep: dict, path: Path) -> list[str]:
    """The scenario; returns the LR variants it covers."""
    lrs = failing_lrs(lr_edge)
    by_value = {float(name.split("-lr")[1]): name.split("-lr")[1]
                for name in sweep["variants"] if name.startswith("fp8-lr")}
    spelled = [by_value[float(lr)] for lr in lrs]
    controlled = arms(ladder)
    variants = {}
    for lr in spelled:
        variants[f"bf16-lr{lr}"] = sweep["variants"][f"bf16-lr{lr}"]
        variants[f"fp8-lr{lr}"] = sweep["variants"][f"fp8-lr{lr}"]
        for arm, flags in controlled.items():
            variants[f"{arm}-lr{lr}"] = [*sweep["variants"][f"fp8-lr{lr}"],
                                         "--gnmr-units", "core_attention",
                                         "--gnmr-measure", TRACED, *flags]
    description = (
        "Issue 56 item 5, the LR edge's controlled round, written by experiments/lr_edge_arms.py "
        "from docs/runs/attention_ladder/ladder.json and the LR round it extends (its base, "
        "its seeds, its judged result) before any of these runs: at the LRs where FP8 fails "
        f"and BF16 does not ({', '.join(spelled)}), "
        "BF16 and FP8 again and the ladder's arms on the core attentions at the settings its "
        f"training round chose (chosen: {ladder['chosen']}; random: two units drawn after the "
        "warm-up and kept).")
    scenario = {"description": description, "base": sweep["base"],
                "smoke": sweep.get("smoke", []), "seeds": sweep["seeds"],
                "smoke_seeds": sweep.get("smoke_seeds", sweep["seeds"][:1]),
                "reference": f"bf16-lr{spelled[0]}", "variants": variants}
    path.write_text(yaml.safe_dump(scenario, sort_keys=False, width=100))
    return spelled


def main(argv: list[str]) -> None:
    if len(argv) != 3:
        sys.exit("usage: python -m megatron_gnmr.experiments.lr_edge_arms LADDER_JSON "
                 "LR_EDGE_JSON SCENARIO (e.g. docs/runs/attention_ladder/ladder.json "
                 "docs/runs/lr_edge_controller/lr_edge.json lr_edge_controller)")
    ladder, lr_edge = (json.loads(Path(p).read_text()) for p in argv[:2])
    sweep = yaml.safe_load((SCENARIO / f"{argv[2]}.yaml").read_text())
    print(write_scenario(ladder, lr_edge, sweep, SCENARIO / "lr_edge_arms.yaml"))


if __name__ == "__main__":
    main(sys.argv[1:])
