"""The LR edge's goal (issue 56 item 5) against verdicts made by hand: where an arm holds,
its edge, its GEMM FLOPs with the probe's, the sign test against FP8, and when nothing is
judged."""

import json

import pytest

from megatron_gnmr.experiments.lr_edge import by_arm, judge
from megatron_gnmr.experiments.lr_edge_goal import judge_goal, lines

SEEDS = [1, 2, 3]


def _run(final, diverged_at=None, cpu="A", gemm=0.0, units=0.0, signal="gnmr", first=None,
         recoveries=None):
    return {"final_train_loss": final, "diverged_at": diverged_at, "initial_loss": 8.0,
            "cpu": cpu, "recovered_gemm_flop_share": gemm,
            "recovered_share_of_executed_steps": units, "first_recovery": first,
            "recoveries": recoveries or {},
            "command": ["python", "pretrain_llama.py", "--gnmr-signals", "fp8_mse",
                        "--gnmr-signals", signal]}


def _sweep():
    """FP8 within the tolerance of BF16 at 0.01 (+0.05), worse by 0.3 at 0.02 and 0.04; BF16
    diverges at 0.16: its divergence edge is 0.08, so an arm must hold up to 0.04."""
    table = {}
    for lr, bf16, fp8 in (("0.01", 4.0, 4.05), ("0.02", 4.0, 4.3), ("0.04", 4.1, 4.4),
                          ("0.08", 4.5, 4.6), ("0.16", 4.9, 5.0)):
        table[f"bf16-lr{lr}"] = {s: _run(bf16) for s in SEEDS}
        table[f"fp8-lr{lr}"] = {s: _run(fp8) for s in SEEDS}
    table["bf16-lr0.16"][2] = _run(9.0, diverged_at=50)
    return json.loads(json.dumps(judge(table)))  # as committed: keys become strings


def _round():
    """At 0.02 and 0.04, BF16 at 4.0, FP8 at 4.3 on every seed; the arms' finals per seed."""
    finals = {
        "good": ([4.02, 4.05, 4.08], [4.0, 4.1, 4.11]),  # means +0.05, +0.07: holds
        "costly": ([4.0, 4.0, 4.0], [4.0, 4.0, 4.0]),    # holds, 20% of the GEMM FLOPs
        "probe": ([4.0, 4.0, 4.0], [4.0, 4.0, 4.0]),     # holds; the probe tips it over 15%
        "dies": ([4.0, 4.0, 4.0], [4.0, 4.0, None]),     # seed 3 diverges at 0.04
        "wanders": ([4.35, 4.2, 4.2], [4.3, 4.3, 4.3]),  # +0.25 at 0.02: 1 of 3 worse than FP8
        "attention-exact": ([4.0, 4.0, 4.0], [4.0, 4.0, 4.0]),  # the positive control
    }
    # (units' GEMM FLOPs run exact, unit-steps run exact): the attention is 0.07 / 0.5 = 14%
    # of the GEMM FLOPs, the median over every run that recovered (costly's and probe's are
    # made up to cross the budget)
    spend = {"good": (0.07, 0.5), "costly": (0.2, 1.0), "probe": (0.149, 0.5),
             "dies": (0.07, 0.5), "wanders": (0.07, 0.5), "attention-exact": (0.14, 1.0)}
    table = {}
    for lr, index in (("0.02", 0), ("0.04", 1)):
        table[f"bf16-lr{lr}"] = {s: _run(4.0) for s in SEEDS}
        table[f"fp8-lr{lr}"] = {s: _run(4.3) for s in SEEDS}
        for arm, per_lr in finals.items():
            gemm, units = spend[arm]
            table[f"{arm}-lr{lr}"] = {s: _run(
                9.0 if final is None else final, diverged_at=40 if final is None else None,
                gemm=gemm, units=units, first=30,
                signal="kernel_output_bias" if arm == "probe" else "gnmr",
                recoveries={"decoder.layers.1.self_attention.core_attention": [[30, 2000]]})
                for s, final in zip(SEEDS, per_lr[index])}
    return table


def _goal(table, complete=True):
    return judge_goal(judge(table), by_arm(table), _sweep(), SEEDS, probe_share=0.02,
                      complete=complete)


def test_an_arm_meets_the_goal_when_it_holds_up_to_a_step_below_bf16s_edge_within_15pct():
    """good: holds at 0.02 and 0.04, edge 0.04 (target: one step below BF16's 0.08), 7% of
    the GEMM FLOPs: met. costly: 20%: not met. probe: 14.9% plus the probe's 2% of the
    attention's FLOPs, the attention being 14% of the GEMM FLOPs, on the half of the
    unit-steps left in FP8: 0.149 + 0.02 * 0.14 * 0.5 = 15.04%: not met. dies: a diverged seed
    at 0.04, edge 0.02. wanders: +0.25 at 0.02, edge 0.01 (where FP8 held in the sweep). The
    positive control holds and is not judged."""
    goal = _goal(_round())
    assert goal["bf16_edge"] == 0.08 and goal["target_edge"] == 0.04
    assert goal["attention_gemm_share"] == pytest.approx(0.14)
    arms = goal["arms"]
    assert set(arms) == {"good", "costly", "probe", "dies", "wanders", "attention-exact"}
    assert arms["good"]["edge"] == 0.04 and arms["good"]["met"] is True
    assert arms["good"]["rows"][0.02]["mean_gap"] == pytest.approx(0.05)
    assert arms["costly"]["edge"] == 0.04 and arms["costly"]["met"] is False
    assert arms["probe"]["gemm_flops"] == pytest.approx(0.149 + 0.02 * 0.14 * 0.5)
    assert arms["probe"]["met"] is False
    assert arms["dies"]["edge"] == 0.02 and arms["dies"]["holds"] == {0.02: True, 0.04: False}
    assert arms["wanders"]["edge"] == 0.01 and arms["wanders"]["met"] is False
    wanders = arms["wanders"]["rows"][0.02]
    assert wanders["better_than_fp8"] == 2 and wanders["sign_p_better_than_fp8"] == \
        pytest.approx(0.5)  # 1 of 3 discordant seeds went FP8's way: P(at most 1 of 3)
    assert arms["good"]["rows"][0.04]["sign_p_better_than_fp8"] == pytest.approx(1 / 8)
    assert arms["attention-exact"]["edge"] == 0.04 and arms["attention-exact"]["met"] is None


def test_nothing_is_met_before_the_round_is_complete_nor_short_of_the_target():
    """Incomplete: every verdict None. Complete but without BF16 at 0.04 in the round, good
    holds at 0.02 only: its edge 0.02 is short of the target 0.04, not met."""
    assert all(v["met"] is None for v in _goal(_round(), complete=False)["arms"].values())
    table = _round()
    del table["bf16-lr0.04"]
    goal = _goal(table)
    assert goal["arms"]["good"]["edge"] == 0.02 and goal["arms"]["good"]["met"] is False


def test_a_bf16_run_that_diverges_in_the_round_pairs_with_nothing():
    """BF16's seed 3 diverges at 0.04 (it counts its initial loss, 8.0): an arm at +0.5 on
    seeds 1 and 2 would have a mean gap of (0.5 + 0.5 - 3.5) / 3 < 0.1 had seed 3 paired; it
    does not, so the arm does not hold there."""
    table = _round()
    table["bf16-lr0.04"][3] = _run(9.0, diverged_at=60)
    table["good-lr0.04"] = {s: _run(4.5, gemm=0.07, units=0.5) for s in SEEDS}
    row = _goal(table)["arms"]["good"]["rows"][0.04]
    assert row["seeds"] == 2 and row["mean_gap"] == pytest.approx(0.5)
    assert _goal(table)["arms"]["good"]["holds"][0.04] is False


def test_a_seed_missing_or_made_on_another_cpu_counts_against_holding():
    table = _round()
    table["good-lr0.02"][3]["cpu"] = "B"
    goal = _goal(table)
    assert goal["arms"]["good"]["holds"][0.02] is False and goal["arms"]["good"]["edge"] == 0.01
    table = _round()
    del table["good-lr0.04"][2]
    assert _goal(table)["arms"]["good"]["holds"][0.04] is False


def test_the_goals_report_names_each_verdict_only_once_the_round_is_complete():
    text = "\n".join(lines(_goal(_round()), complete=True))
    assert "- good: edge 0.04, GEMM FLOPs exact at most 7.0%: **met**." in text
    assert "- dies: edge 0.02" in text and "**not met**" in text
    assert "| good | 0.02 | +0.020, +0.050, +0.080 | +0.050 | yes | 3/3 (0.125) | 7.0% | " \
        "1: 30 [1]; 2: 30 [1]; 3: 30 [1] |" in text
    assert "| attention-exact | 0.02 |" in text and "- attention-exact:" not in text
    text = "\n".join(lines(_goal(_round(), complete=False), complete=False))
    assert "**The round is not complete**" in text and "**met**" not in text
