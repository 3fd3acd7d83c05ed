"""The LR edge's goal (issue 56 item 5) against verdicts made by hand: where an arm holds,
its edge, its GEMM FLOPs with the probe's, and the sign test against FP8."""

import json

import pytest

from megatron_gnmr.experiments.lr_edge import judge
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
    }
    spend = {"good": (0.10, 0.5), "costly": (0.2, 1.0), "probe": (0.149, 0.5),
             "dies": (0.07, 0.5), "wanders": (0.07, 0.5)}
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


def _by_arm(table):
    out = {}
    for variant, runs in table.items():
        arm, _, lr = variant.rpartition("-lr")
        out.setdefault(arm, {})[float(lr)] = runs
    return out


def test_an_arm_meets_the_goal_when_it_holds_up_to_a_step_below_bf16s_edge_within_15pct():
    """good: holds at 0.02 and 0.04, edge 0.04 (target: one step below BF16's 0.08), 10% of
    the GEMM FLOPs: met. costly: 20%: not met. probe: 14.9% plus the probe's 2% of the
    attention's FLOPs, the attention being 0.149 / 0.5 = 29.8% of the GEMM FLOPs, on the half
    of the unit-steps left in FP8: 0.149 + 0.02 * 0.298 * 0.5 = 15.2%: not met. dies: a
    diverged seed at 0.04, edge 0.02. wanders: +0.25 at 0.02, edge 0.01 (where FP8 held in the
    sweep)."""
    table = _round()
    goal = judge_goal(judge(table), _by_arm(table), _sweep(), SEEDS, probe_share=0.02)
    assert goal["bf16_edge"] == 0.08 and goal["target_edge"] == 0.04
    arms = goal["arms"]
    assert set(arms) == {"good", "costly", "probe", "dies", "wanders"}
    assert arms["good"]["edge"] == 0.04 and arms["good"]["met"]
    assert arms["good"]["rows"][0.02]["mean_gap"] == pytest.approx(0.05)
    assert arms["costly"]["edge"] == 0.04 and not arms["costly"]["met"]
    assert arms["probe"]["gemm_flops"] == pytest.approx(0.149 + 0.02 * 0.298 * 0.5)
    assert not arms["probe"]["met"]
    assert arms["dies"]["edge"] == 0.02 and arms["dies"]["holds"] == {0.02: True, 0.04: False}
    assert arms["wanders"]["edge"] == 0.01 and not arms["wanders"]["met"]
    wanders = arms["wanders"]["rows"][0.02]
    assert wanders["better_than_fp8"] == 2 and wanders["sign_p_better_than_fp8"] == \
        pytest.approx(0.5)  # 1 of 3 discordant seeds went FP8's way: P(at most 1 of 3)
    assert arms["good"]["rows"][0.04]["sign_p_better_than_fp8"] == pytest.approx(1 / 8)


def test_a_seed_missing_or_made_on_another_cpu_counts_against_holding():
    table = _round()
    table["good-lr0.02"][3]["cpu"] = "B"
    goal = judge_goal(judge(table), _by_arm(table), _sweep(), SEEDS, probe_share=0.02)
    assert goal["arms"]["good"]["holds"][0.02] is False and goal["arms"]["good"]["edge"] == 0.01
    table = _round()
    del table["good-lr0.04"][2]
    goal = judge_goal(judge(table), _by_arm(table), _sweep(), SEEDS, probe_share=0.02)
    assert goal["arms"]["good"]["holds"][0.04] is False


def test_the_goals_report_names_each_verdict_only_once_the_round_is_complete():
    table = _round()
    goal = judge_goal(judge(table), _by_arm(table), _sweep(), SEEDS, probe_share=0.02)
    text = "\n".join(lines(goal, complete=True))
    assert "- good: edge 0.04, GEMM FLOPs exact at most 10.0%: **met**." in text
    assert "- dies: edge 0.02" in text and "**not met**" in text
    assert "| good | 0.02 | +0.020, +0.050, +0.080 | +0.050 | yes | 3/3 (0.125) | 10.0% | " \
        "1: 30 [1]; 2: 30 [1]; 3: 30 [1] |" in text
    text = "\n".join(lines(goal, complete=False))
    assert "**The round is not complete**" in text and "**met**" not in text
