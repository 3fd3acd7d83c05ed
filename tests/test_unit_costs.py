"""Budgets in FLOPs: the units' GEMM costs by hand for a small model, the share a plan
recovers, and the policy's bucket counted in FLOPs against a hand-computed trace."""

import numpy as np
import pytest

from megatron_gnmr.arguments import parse_config
from megatron_gnmr.controller.config import GNMRConfig
from megatron_gnmr.controller.policy import GNMRPolicy
from megatron_gnmr.controller.units import UnitShape
from megatron_gnmr.precision.plan import PrecisionPlan
from megatron_gnmr.precision.unit_costs import RecoveredShare, unit_costs

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "176",
         "--num-attention-heads", "4", "--num-query-groups", "2", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4",
         "--precision-recipe", "fp8-emulated"]
# By hand, fprop MACs per token (K x N), head dim 16: qkv 64 x (4 + 2 x 2) x 16 = 8192,
# proj 64 x 64 = 4096, fc1 (SwiGLU) 64 x 2 x 176 = 22528, fc2 176 x 64 = 11264.
PER_TOKEN = {"self_attention.linear_qkv": 8192, "self_attention.linear_proj": 4096,
             "mlp.linear_fc1": 22528, "mlp.linear_fc2": 11264}
LAYER = sum(PER_TOKEN.values())  # 46080
TOKENS = 4 * 32  # global batch x sequence


def _config(*extra):
    return parse_config([*SMALL, *extra])


def test_unit_costs_by_hand():
    config = _config()
    names = UnitShape.of_run(config).names()
    costs = unit_costs(config, names)
    expected = [3 * TOKENS * PER_TOKEN[name.split(".", 2)[2]] for name in names]
    assert costs.tolist() == expected
    # fc1 costs about twice fc2 and almost three times qkv: a unit is no unit of cost
    assert costs[2] / costs[3] == 2.0


def test_core_attention_costs_its_two_gemms():
    config = _config("--attention-precision", "fp8")
    names = UnitShape.of_run(config).names()
    core = names.index("layers.0.self_attention.core_attention")
    # QK^T and PV over the full 32 x 32 square: 2 x 32 x (4 heads x 16) MACs per token
    assert unit_costs(config, names)[core] == 3 * TOKENS * 2 * 32 * 64


@pytest.mark.parametrize("gemms, part", [("fprop,dgrad,wgrad", 1.0), ("wgrad", 1 / 3),
                                         ("fprop,wgrad", 2 / 3)])
def test_recovered_share_of_a_plan(gemms, part):
    config = _config("--precision-recovery-gemms", gemms)
    names = UnitShape.of_run(config).names()
    share = RecoveredShare(config, names)
    plan = PrecisionPlan(recovery=frozenset({"layers.0.mlp.linear_fc1"}))
    assert share.of(plan) == pytest.approx(part * 22528 / (2 * LAYER), rel=1e-12)
    plan.always = frozenset({"layers.1.self_attention.linear_proj"})
    assert share.of(plan) == pytest.approx(part * (22528 + 4096) / (2 * LAYER), rel=1e-12)
    assert share.of(PrecisionPlan(all_recovery=True)) == pytest.approx(part, rel=1e-12)
    assert share.of(PrecisionPlan()) == 0.0


def test_budget_costs_add_up_to_the_units_count():
    config = _config()
    names = UnitShape.of_run(config).names()
    eligible = [n for n in names if "linear_fc" in n]
    costs = RecoveredShare(config, names).budget_costs(eligible)
    # the eligible units are the MLP's: (22528 + 11264) / 46080 of the model, scaled to 4
    assert sum(costs) == pytest.approx(4 * (22528 + 11264) / LAYER, rel=1e-12)
    assert costs[0] / costs[1] == pytest.approx(2.0)


def test_policy_bucket_in_flops_follows_a_hand_trace():
    # three units of costs 1.5, 0.75, 0.75 (together 3 = the unit count), always risky by
    # another signal, in risk order 0 > 1 > 2; 0.5 x 3 = 1.5 of budget per step, the bucket
    # holds at most max_o x the costliest unit = 3
    config = GNMRConfig(delta=1, warmup=2, max_o=2, budget_rate=0.5, budget_in="flops")
    policy = GNMRPolicy(config, 3, [1.5, 0.75, 0.75])
    risk = np.array([3.0, 2.0, 1.5])
    decided = [policy.step(np.ones(3), risk, use_gnmr=False).recovery for _ in range(6)]
    # warm-up: nothing risky, the bucket fills to 1.5, then 3.0; step 3 pays 1.5 + 0.75
    # (max_o reached), 0.75 left; step 4: 2.25 -> both again, 0 left; steps 5, 6: 1.5 pays
    # for unit 0 only (unit 1 would need 0.75 more)
    assert decided == [(), (), (0, 1), (0, 1), (0,), (0,)]
    assert policy.summary()["recovery_cost_share"] == pytest.approx(7.5 / 18)
    assert policy.summary()["recovery_sparsity"] == pytest.approx(6 / 18)


def test_policy_bucket_in_units_is_unchanged_by_costs():
    config = GNMRConfig(delta=1, warmup=2, max_o=2, budget_rate=0.5)
    with_costs = GNMRPolicy(config, 3, [1.5, 0.75, 0.75])
    plain = GNMRPolicy(config, 3)
    risk = np.array([3.0, 2.0, 1.5])
    for _ in range(8):
        assert with_costs.step(np.ones(3), risk, use_gnmr=False).recovery == \
            plain.step(np.ones(3), risk, use_gnmr=False).recovery


def test_first_and_last_layers_kept_high():
    from megatron_gnmr.precision.kept_high import kept_high

    config = parse_config([*SMALL[:1], "4", *SMALL[2:], "--first-last-layers-bf16",
                           "--num-layers-at-start-in-bf16", "0",
                           "--num-layers-at-end-in-bf16", "2"])
    names = UnitShape.of_run(config).names()
    assert sorted(kept_high(config.precision, names)) == sorted(
        n for n in names if n.startswith(("layers.2.", "layers.3.")))
