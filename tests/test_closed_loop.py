"""The closed-loop table (`megatron-gnmr compare-closed-loop`) on hand-made run summaries,
and the scenario's every variant a valid run."""

import pytest

from megatron_gnmr.experiments.closed_loop import variant_rows


def summary(diverged_at=None, first_recovery=None, share=0.0, loss=4.0, steps=3000):
    return {"diverged_at": diverged_at, "first_recovery": first_recovery,
            "first_attention_alarm": first_recovery - 1 if first_recovery else None,
            "recovered_unit_step_share": share, "final_train_loss": loss,
            "steps": steps if diverged_at is None else diverged_at}


def test_the_table_by_hand():
    table = {
        "no-control": {1: summary(1000), 2: summary(1500), 3: summary(2000)},
        "exact-attention": {1: summary(loss=3.9), 2: summary(loss=4.0), 3: summary(loss=4.1)},
        "loop-no-budget": {1: summary(1100), 2: summary(1600), 3: summary()},
        # seed 1: saved; seed 2: recovered after the twin died and died too; seed 3: never
        # in danger
        "loop-trend": {1: summary(None, 900, 0.3, loss=4.0), 2: summary(1700, 1650, 0.1),
                       3: summary(None, None, 0.0, loss=4.3)},
    }
    rows = {row["variant"]: row for row in variant_rows(table)}
    loop = rows["loop-trend"]
    assert loop["diverged"] == "1 / 3" and loop["divergence steps"] == "- 1700 -"
    assert loop["saved where its no-budget twin diverged"] == "1 / 2"
    # recoveries against the uncontrolled run's divergence of the same seed: 900 < 1000,
    # 1650 > 1500 (median lead of +100 and -150: -25)
    assert loop["recovery before uncontrolled divergence"] == "1 / 2 (median lead -25)"
    assert loop["unit-steps (= attention FLOPs) recovered"] == "13.3%"
    # the gap to exact, paired by seed, over the runs that lived: 4.0-3.9, 4.3-4.1
    gaps = loop["final loss gap to exact (runs that did not diverge)"]
    assert gaps.startswith("+0.150 +- 0.071") and gaps.endswith("(n=2)")
    assert rows["no-control"]["diverged"] == "3 / 3"


def test_every_variant_of_the_closed_loop_scenario_is_a_valid_run(tmp_path):
    from megatron_gnmr.arguments import parse_config
    from megatron_gnmr.experiments.scenario import load_scenario
    from megatron_gnmr.validation import validate

    scenario = load_scenario("attention_closed_loop")
    assert len(scenario.seeds) >= 8
    for variant, seed, flags in scenario.runs(smoke=False):
        config = parse_config([*flags, "--save", str(tmp_path / f"{variant}-{seed}")])
        validate(config, world_size=1)  # (reproduce gives each run its --save)
        assert config.training.stop_on_divergence
        assert config.precision.attention_precision == "fp8"
        if config.gnmr.enabled:  # the same budget bound and units for every rule
            assert config.gnmr.units == "core_attention", variant


@pytest.mark.parametrize("variant", ["loop-trend"])
def test_the_loops_act_on_the_monitor_alone(variant):
    from megatron_gnmr.arguments import parse_config
    from megatron_gnmr.experiments.scenario import load_scenario

    scenario = load_scenario("attention_closed_loop")
    config = parse_config([*scenario.base, *scenario.variants[variant]])
    assert config.gnmr.signals == "monitor" and config.monitor.monitors == "attention"
