"""The held-out round's run order: arms only where the twin died, asked only once it ran."""

from types import SimpleNamespace

from megatron_gnmr.experiments.ladder_held_out_runs import (
    PASSES,
    healthy_runs,
    pass_runs,
    secondary_twins,
)

SCENARIO = SimpleNamespace(variants={v: [] for v in (
    "healthy", "exact-attention", "twin-a", "twin-b", "twin-alone",
    "chosen@a", "te-o@a", "te-latch@a", "random@a",
    "chosen@b", "te-o@b", "te-latch@b", "random@b",
    "healthy-chosen", "healthy-te-o", "healthy-te-latch", "healthy-random")})


def test_a_pass_runs_the_twins_first_and_arms_only_on_the_rung_whose_twin_died():
    ran = []

    def died(variant, seed):
        assert {"twin-a", "twin-b"} <= set(ran), "asked before the twins ran"
        return variant == "twin-a" and seed == 7

    def run_pass(seed, arms):
        ran.clear()
        for variant in pass_runs(SCENARIO, seed, arms, died):
            ran.append(variant)  # the runner runs each before asking for the next
        return list(ran)

    base = ["twin-a", "twin-b", "exact-attention", "healthy"]
    assert run_pass(7, PASSES[0]) == [*base, "chosen@a", "te-o@a"]
    assert run_pass(7, PASSES[1]) == [*base, "te-latch@a"]
    assert run_pass(7, PASSES[2]) == [*base, "random@a"]  # the goal's arms first
    assert run_pass(8, PASSES[0]) == base
    assert secondary_twins(SCENARIO) == ["twin-alone"]  # run last, in a pass of their own


def test_a_healthy_arm_runs_only_where_its_rule_fires_on_the_healthy_trace():
    fired = []

    def fires(rule, seed):
        fired.append(rule)
        return rule.startswith("te-o@")

    assert healthy_runs(SCENARIO, 7, PASSES[0], fires) == ["healthy-te-o"]
    assert fired == ["chosen@a", "te-o@a"]  # each arm replayed once, on its first rung's rule
