"""The closed-loop comparison (`megatron-gnmr compare-closed-loop`) on hand-made run
summaries with every figure computed by hand; a run's summary from hand-made logs; Fisher's
exact test against the hypergeometric tail written out; and the scenario's every arm a valid
run."""

import json
import math

import pytest

from megatron_gnmr.errors import UserError
from megatron_gnmr.experiments import closed_loop_earlier
from megatron_gnmr.experiments.closed_loop import comparisons, outcomes, variant_rows
from megatron_gnmr.experiments.closed_loop_runs import run_summary
from megatron_gnmr.experiments.closed_loop_statistics import fisher_one_sided, harm_margin


def summary(diverged_at=None, first_recovery=None, share=0.0, loss=4.0, curve=None):
    return {"diverged_at": diverged_at, "first_recovery": first_recovery,
            "first_attention_alarm": first_recovery - 1 if first_recovery else None,
            "recovered_share_of_executed_steps": share, "final_train_loss": loss,
            "loss_every_25_steps": curve or {"25": 6.0, "50": 5.5}, "cpu": "test CPU",
            "commits": ["abc"]}


TABLE = {
    "no-control": {1: summary(1000), 2: summary(1500), 3: summary(2000)},
    "exact-attention": {1: summary(loss=3.9), 2: summary(loss=4.0), 3: summary(loss=4.1)},
    "loop-no-budget": {1: summary(1100), 2: summary(1600), 3: summary(loss=4.2)},
    # seed 1: saved (its twin died at 1100); seed 2: recovered after its twin died, died too;
    # seed 3: lived, but 0.25 above exact attention's 4.1: harmed (the margin is 0.2)
    "loop-early": {1: summary(None, 900, 0.3, loss=4.0, curve={"25": 6.0, "50": 5.5}),
                   2: summary(1700, 1650, 0.1),
                   3: summary(None, None, 0.0, loss=4.35)},
}


def test_the_margin_is_twice_the_exact_arms_spread():
    assert harm_margin([3.9, 4.0, 4.1]) == pytest.approx(0.2)  # sample sd 0.1
    assert outcomes(TABLE)["margin"] == pytest.approx(0.2)


def test_the_table_by_hand():
    rows = {row["arm"]: row for row in variant_rows(TABLE)}
    loop = rows["loop-early"]
    assert loop["diverged"] == "1 / 3"
    assert loop["failed (diverged or harmed)"] == "2 / 3"  # seed 2 diverged, seed 3 harmed
    assert loop["saved where its twin diverged"] == "1 / 2"  # the twin died on seeds 1, 2
    # budget: shares 0.3, 0.1, 0.0: mean 13.3%, sd 0.1528 / sqrt(3) = 8.8%
    assert loop["attention FLOPs exact (of the steps run)"] == "13.3% +- 8.8 (n=3)"
    # leads over the twin's divergence: 1100 - 900 = 200, 1600 - 1650 = -50; median 75
    assert loop["lead over the twin's divergence (median)"] == "75"
    # gaps to exact of the seeds that lived: 0.10 and 0.25; mean 0.175, sd 0.106 / sqrt 2
    assert loop["final loss gap to exact"] == "+0.175 +- 0.075 (n=2)"
    assert loop["first recovery (median step)"] == "1275"
    assert loop["follows its twin until its first recovery"] == "2 / 2"
    assert rows["no-control"]["diverged"] == "3 / 3"
    assert rows["no-control"]["saved where its twin diverged"] == "-"
    assert rows["loop-no-budget"]["failed (diverged or harmed)"] == "2 / 3"  # 4.2 - 4.1 < 0.2


def test_a_run_that_left_its_twin_before_recovering_is_counted():
    table = {**TABLE, "loop-early": {**TABLE["loop-early"],
                                     1: summary(None, 900, 0.3, curve={"25": 6.0, "50": 5.4})}}
    row = next(r for r in variant_rows(table) if r["arm"] == "loop-early")
    assert row["follows its twin until its first recovery"] == "1 / 2"
    # recovering before step 25, the first step compared, leaves nothing to check
    table["loop-early"][1] = summary(None, 20, 0.3, curve={"25": 6.0, "50": 5.4})
    row = next(r for r in variant_rows(table) if r["arm"] == "loop-early")
    assert row["follows its twin until its first recovery"] == "1 / 1"


def test_the_comparisons_by_hand():
    rows = {(r["loop"], r["against"]): r for r in comparisons(TABLE)}
    # failed 2/3 vs 3/3: 5 failures in 6 runs; P(X <= 2) = C(3,2) C(3,3) / C(6,5) = 0.5, and
    # the other direction P(X >= 2) = 1 (the other arm holds at most 3 of the 5)
    assert rows[("loop-early", "no-control")]["failed"] == \
        "2/3 vs 3/3, p = 0.5 (the loop less), 1 (the other less)"
    # diverged 1/3 vs 3/3: 4 in 6; P(X <= 1) = C(3,1) C(3,3) / C(6,4) = 3 / 15; P(X >= 1) = 1
    assert rows[("loop-early", "no-control")]["diverged"] == \
        "1/3 vs 3/3, p = 0.2 (the loop less), 1 (the other less)"
    assert ("loop-early", "exact-attention") not in rows


def _earlier(directory, name, cpu, **fields):
    directory.mkdir(exist_ok=True)
    record = {"run": name, "finished": True, "steps": 1200, "diverged_at": 1200,
              "first_attention_alarm": None, "alarms": 0, "first_recovery": None,
              "recovered_unit_step_share": 0.0, "final_train_loss": 5.3,
              "final_valid_loss": 5.0, "cpu": cpu, **fields}
    (directory / f"{name}.json").write_text(json.dumps(record))


def test_an_earlier_round_fills_only_what_is_missing_and_only_from_the_same_cpu(tmp_path):
    """The earlier round's twin of seed 4 (absent here) joins the table with its divergence;
    its twin of seed 1 (present here) does not replace this round's; one made on another CPU
    model is refused by name."""
    earlier = tmp_path / "issue30"
    _earlier(earlier, "loop-no-budget-seed4", "test CPU", diverged_at=800)
    _earlier(earlier, "loop-no-budget-seed1", "test CPU", diverged_at=5)
    table = {arm: dict(runs) for arm, runs in TABLE.items()}
    added = closed_loop_earlier.merge(table, earlier, list(TABLE), [1, 2, 3, 4])
    assert added == ["loop-no-budget-seed4"]
    assert table["loop-no-budget"][4]["diverged_at"] == 800
    assert table["loop-no-budget"][1]["diverged_at"] == 1100  # this round's own
    row = next(r for r in variant_rows(table) if r["arm"] == "loop-no-budget")
    assert row["diverged"] == "3 / 4"
    _earlier(earlier, "no-control-seed4", "another CPU")
    with pytest.raises(UserError, match="no-control-seed4.json: made on 'another CPU'"):
        closed_loop_earlier.merge({arm: dict(runs) for arm, runs in TABLE.items()}, earlier,
                                  list(TABLE), [4])


@pytest.mark.parametrize("a, n_a, b, n_b", [(0, 16, 14, 16), (3, 10, 5, 12), (2, 2, 0, 3)])
def test_fisher_is_the_hypergeometric_lower_tail(a, n_a, b, n_b):
    total = a + b
    tail = sum(math.comb(n_a, k) * math.comb(n_b, total - k)
               for k in range(0, a + 1) if 0 <= total - k <= n_b) / math.comb(n_a + n_b, total)
    assert fisher_one_sided(a, n_a, b, n_b) == pytest.approx(tail, rel=1e-12)


def test_a_run_summary_from_its_logs(tmp_path):
    """Two core attentions; the decision of step s is the recovery set of step s + 1. Unit 0
    recovers in steps 3, 4 and 6, unit 1 in step 4: 4 unit-steps of 2 x 6 run; the GEMM FLOPs
    run exact, as logged, average 0.28 / 6."""
    run = tmp_path / "loop-early-seed1"
    run.mkdir()
    losses = [6.0, 5.0, 4.8, 4.7, 4.6, 4.5]
    flop_shares = [0.0, 0.0, 0.07, 0.14, 0.0, 0.07]  # the share of GEMM FLOPs run exact
    (run / "metrics.jsonl").write_text("\n".join(
        [json.dumps({"step": s + 1, "train/loss": loss,
                     "precision/recovered_flop_share": flop_shares[s]})
         for s, loss in enumerate(losses)] +
        [json.dumps({"step": 2, "event": "alarm", "layer": 1, "signal": "attention_error",
                     "detector": "threshold", "value": 0.7})]))
    units = ["layers.0.self_attention.core_attention", "layers.1.self_attention.core_attention"]
    decisions = {2: [0], 3: [0, 1], 5: [0], 6: [1]}  # step 6's decision has no step 7
    (run / "gnmr_trace.jsonl").write_text("\n".join(
        [json.dumps({"type": "header", "units": units})] +
        [json.dumps({"step": s, "recovery": decisions.get(s, [])}) for s in range(1, 7)]))
    (run / "summary.json").write_text("{}")
    result = run_summary(run)
    assert result["steps"] == 6 and result["diverged_at"] is None and result["finished"]
    assert result["recoveries"] == {units[0]: [[3, 4], [6, 6]], units[1]: [[4, 4]]}
    assert result["first_recovery"] == 3
    assert result["recovered_share_of_executed_steps"] == pytest.approx(4 / 12)
    assert result["recovered_gemm_flop_share"] == pytest.approx(0.28 / 6)
    assert result["final_train_loss"] == pytest.approx(sum(losses) / 6)
    assert result["first_attention_alarm"] == 2
    assert result["loss_every_25_steps"] == {"6": 4.5}


EARLY_BUDGET = 0.326  # the early loop's measured share of unit-steps (the scenario's note)
MEASURED = "attention_error,fp8_underflow,fp8_mse"  # what every --gnmr arm traces for replay
# The risk signal each rule's name stands for: the loop's code path (its twin, and the trend
# model) reads the monitors, the early detector the attention's delta error.
SIGNAL_OF = {"loop-no-budget": "monitor", "loop-trend": "monitor",
             "loop-early": "attention_error", "loop-early-cycle": "attention_error",
             "autoswitch": "autoswitch", "random": "random", "gnmr": "gnmr"}


def named_control(arm: str) -> dict[str, object]:
    """What an arm's name says of its control, as config fields: the fault is off in the
    no-fault arms and otherwise the scenario's (1 bit); the rest of the name is the rule."""
    rule = arm.removeprefix("no-fault-")
    said = {"training.attention_fault_bits": 0 if rule != arm else 1,
            "gnmr.enabled": rule != "no-control", "precision.precision_static": "low"}
    if rule == "exact-attention":
        return {**said, "precision.precision_static": "recovery"}
    if rule != "no-control":
        named = rule.removesuffix("-at-early-budget")
        assert named in SIGNAL_OF, f"{arm}: say here what this arm's name means"
        said["gnmr.signals"] = SIGNAL_OF[named]
    if rule == "loop-no-budget":
        said["gnmr.max_o"] = 0
    if rule.startswith("loop-early"):  # held once alarmed; the cycle releases it
        said["gnmr.attention_error_hold"] = 0 if rule.endswith("-cycle") else -1
    if rule.endswith("-at-early-budget"):
        said["gnmr.budget_rate"] = EARLY_BUDGET
    return said


def _field(config, dotted: str):
    section, name = dotted.split(".")
    return getattr(getattr(config, section), name)


def _outside_control(config) -> dict:
    """The run but for its control (the gnmr section, --precision-static), its fault and its
    run directory: the model, data, seed and schedule."""
    values = config.to_dict()
    del values["gnmr"], values["precision"]["precision_static"]
    del values["training"]["attention_fault_bits"], values["checkpoint"]["save"]
    return values


def test_every_arm_of_the_closed_loop_scenario_is_a_valid_run(tmp_path):
    """Every arm is a valid run whose flags do what its name says (the fault off in the
    no-fault arms, the rule it names, a budget where it names one), and every arm differs
    from its twin (loop-no-budget, same seed) only in its control and, named, its fault: the
    same model, data, seed and schedule, so a comparison with the twin is one of rules."""
    from megatron_gnmr.arguments import parse_config
    from megatron_gnmr.experiments.scenario import load_scenario
    from megatron_gnmr.validation import validate

    scenario = load_scenario("attention_closed_loop")
    assert len(scenario.seeds) >= 16
    configs = {}
    for variant, seed, flags in scenario.runs(smoke=False):
        config = parse_config([*flags, "--save", str(tmp_path / f"{variant}-{seed}")])
        validate(config, world_size=1)  # (reproduce gives each run its --save)
        assert config.training.stop_on_divergence
        assert config.precision.attention_precision == "fp8"
        if config.gnmr.enabled:  # the same units for every rule
            assert config.gnmr.units == "core_attention", variant
            assert config.gnmr.measure == MEASURED, variant
        assert config.training.seed == seed
        configs[variant, seed] = config
    assert {"loop-no-budget", "no-control", "exact-attention"} <= set(scenario.variants)
    for (variant, seed), config in configs.items():
        said = named_control(variant)
        assert {name: _field(config, name) for name in said} == said, variant
        if variant.startswith("random"):  # a random rule spends by a budget
            assert config.gnmr.budget_rate > 0, variant
        assert _outside_control(config) == _outside_control(configs["loop-no-budget", seed]), \
            variant
        if variant.startswith("no-fault-") and config.gnmr.enabled:  # the faulted arm's rule
            faulted = configs[variant.removeprefix("no-fault-"), seed]
            assert config.gnmr == faulted.gnmr, variant


def test_healthy_arms_have_a_table_of_their_own():
    """Arms run without the fault are no saves and in no test: their table is what a rule
    spends for nothing, and its loss against the healthy run left alone and exact."""
    from megatron_gnmr.experiments.closed_loop import healthy_rows

    table = {**TABLE,
             "no-fault-no-control": {1: summary(loss=3.95), 2: summary(loss=4.05)},
             "no-fault-loop-early": {1: summary(None, None, 0.0, loss=3.95),
                                     2: summary(None, None, 0.0, loss=4.05)},
             "no-fault-autoswitch": {1: summary(None, 3, 0.9, loss=3.85),
                                     2: summary(None, 3, 0.7, loss=4.05)}}
    assert not any(r["arm"].startswith("no-fault") for r in variant_rows(table))
    assert not any(r["against"].startswith("no-fault") for r in comparisons(table))
    rows = {r["arm (no fault)"]: r for r in healthy_rows(table)}
    spend = rows["no-fault-autoswitch"]
    # shares 0.9 and 0.7: mean 80%, sample sd 0.1414 / sqrt 2 = 10%
    assert spend["attention FLOPs exact, spent for nothing"] == "80.0% +- 10.0 (n=2)"
    # to the healthy run alone: -0.10 and 0.00; to exact (3.9, 4.0): -0.05 and +0.05
    assert spend["final loss gap to the healthy run left alone"] == "-0.050 +- 0.050 (n=2)"
    assert spend["final loss gap to exact"] == "+0.000 +- 0.050 (n=2)"
    assert spend["first recovery (median step)"] == "3"
    quiet = rows["no-fault-loop-early"]
    assert quiet["attention FLOPs exact, spent for nothing"] == "0.0% +- 0.0 (n=2)"
    assert quiet["first recovery (median step)"] == "-"
    assert rows["no-fault-no-control"]["final loss gap to the healthy run left alone"] == "-"
