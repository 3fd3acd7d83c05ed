"""compare-frontier's arithmetic on hand-made per-run summaries: the gate in standard errors,
the gap a rule recovers paired by seed, the bootstrap interval, and the pairing against the
best production rule within a budget."""

import json

import numpy as np
import pytest

from megatron_gnmr.errors import UserError
from megatron_gnmr.experiments import frontier

SPEC = {"low": "all-low", "high": "all-high", "production": ["last-1", "first-1"],
        "ours": ["calibrated"], "run-time": ["qerr"]}


def _summary(loss, share, units=()):
    return {"train_loss_last_tenth": loss, "flop_share": share, "most_recovered":
            [[u, 1.0] for u in units], "recovery_gemms": "fprop,dgrad,wgrad", "cpu": "x"}


def _table():
    low = {1: 5.00, 2: 5.10, 3: 4.90, 4: 5.05}
    high = {1: 4.90, 2: 4.98, 3: 4.82, 4: 4.93}  # gaps 0.10, 0.12, 0.08, 0.12
    return {
        "all-low": {s: _summary(v, 0.0) for s, v in low.items()},
        "all-high": {s: _summary(v, 1.0) for s, v in high.items()},
        # recovers half of each seed's gap
        "last-1": {s: _summary(low[s] - 0.5 * (low[s] - high[s]), 0.125, ["layers.7.x"])
                   for s in low},
        # recovers a quarter
        "first-1": {s: _summary(low[s] - 0.25 * (low[s] - high[s]), 0.125) for s in low},
        # recovers 0.9, 0.8, 1.0, 0.9
        "calibrated": {s: _summary(low[s] - r * (low[s] - high[s]), 0.12)
                       for s, r in zip(low, (0.9, 0.8, 1.0, 0.9))},
        # over the budget: not compared at 12.5%
        "qerr": {s: _summary(low[s] - (low[s] - high[s]), 0.3) for s in low},
    }


def test_gate_counts_standard_errors_of_the_paired_gap():
    result = frontier.gate(_table(), "all-low", "all-high")
    gaps = [0.10, 0.12, 0.08, 0.12]
    assert result["gaps"] == pytest.approx(gaps)
    error = np.std(gaps, ddof=1) / 2
    assert result["in_standard_errors"] == pytest.approx(np.mean(gaps) / error)
    assert result["passed"]  # 0.105 / 0.0096 = 11.0 standard errors
    noisy = _table()
    noisy["all-high"][1]["train_loss_last_tenth"] = 5.20  # one seed the other way
    assert not frontier.gate(noisy, "all-low", "all-high")["passed"]


def test_gap_recovered_is_paired_by_seed():
    rows = {r["rule"]: r for r in frontier.rule_rows(_table(), SPEC)}
    assert rows["last-1"]["recovered"] == pytest.approx({1: 0.5, 2: 0.5, 3: 0.5, 4: 0.5})
    assert rows["calibrated"]["recovered_mean"] == pytest.approx(0.9)
    assert rows["all-low"]["recovered_mean"] == 0.0 and rows["all-high"]["recovered_mean"] == 1
    low, high = rows["calibrated"]["recovered_interval"]
    assert 0.8 <= low < 0.9 < high <= 1.0
    assert rows["last-1"]["chosen_most"] == ["layers.7.x"]
    # sorted by FLOP share
    assert [r["rule"] for r in frontier.rule_rows(_table(), SPEC)][0] == "all-low"


def test_rules_are_paired_with_the_best_production_rule_within_their_budget():
    rows = frontier.rule_rows(_table(), SPEC)
    verdicts = frontier.against_best_production(rows, [0.125])
    assert [(v["rule"], v["best_production"]) for v in verdicts] == [("calibrated", "last-1")]
    assert verdicts[0]["difference"] == pytest.approx(0.4)
    assert verdicts[0]["interval"][0] > 0  # every seed is better by 0.3 to 0.5


def test_bootstrap_interval_of_a_constant_is_the_constant():
    assert frontier.bootstrap_interval([0.3, 0.3, 0.3]) == pytest.approx((0.3, 0.3))


def test_markdown_and_plot_from_summaries(tmp_path):
    table = _table()
    rows = frontier.rule_rows(table, SPEC)
    text = frontier.markdown("stress", table, SPEC, rows,
                             frontier.against_best_production(rows, [0.125]),
                             frontier.gate(table, "all-low", "all-high"))
    assert "11.0 standard errors (passed" in text
    assert "| calibrated | ours | 12.0% |" in text
    frontier.plot("stress", rows, tmp_path / "frontier.png")
    assert (tmp_path / "frontier.png").stat().st_size > 10_000


def test_a_scenario_without_a_frontier_section_is_refused():
    with pytest.raises(UserError, match="no `frontier:` section"):
        frontier.frontier_spec("risk_signals_act_quant")


def test_reproduce_refuses_an_unknown_variant(tmp_path):
    from megatron_gnmr.experiments.runner import reproduce
    from megatron_gnmr.experiments.scenario import load_scenario

    with pytest.raises(UserError, match="no variant all-medium"):
        reproduce(load_scenario("frontier_act_quant"), tmp_path, smoke=True,
                  variants=["all-medium"])
    assert json.dumps(list(tmp_path.iterdir())) == "[]"


def test_calibration_summary_is_each_units_mean_and_standard_error(tmp_path):
    run = tmp_path / "calibration-seed101"
    run.mkdir()
    rows = [[0.1, None], [0.3, 0.5], [0.2, 0.7]]  # the second unit unmeasured at step 1
    lines = [{"type": "header", "format": 2, "units": ["a", "b"], "config": {},
              "signal_settings": {}, "measured": ["loss_cost"]}]
    lines += [{"step": i, "norms": [1.0, 1.0], "recovery": [], "loss_cost": row}
              for i, row in enumerate(rows, start=1)]
    (run / "gnmr_trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (run / "metrics.jsonl").write_text(json.dumps({"valid/loss": 4.5}) + "\n")
    summary = frontier.calibration_summary(run)
    a, b = summary["measured"]["loss_cost"]["a"], summary["measured"]["loss_cost"]["b"]
    assert a["mean"] == pytest.approx(0.2) and b["mean"] == pytest.approx(0.6)
    assert a["standard_error"] == pytest.approx(0.1 / np.sqrt(3))  # sample std 0.1
    assert b["standard_error"] == pytest.approx(np.sqrt(0.02) / np.sqrt(2))
    assert summary["steps"] == 3 and summary["final_valid_loss"] == 4.5
