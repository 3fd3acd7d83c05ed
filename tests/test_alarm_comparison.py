"""`compare-alarms` on synthetic run directories: leave-one-out references, false alarms in
healthy runs and before a mid-run fault, lead over divergence."""

import json

import numpy as np

from megatron_gnmr.experiments.alarm_comparison import compare
from megatron_gnmr.experiments.scenario import Scenario

INTERVAL, CHECKS = 25, 120


def _write_run(path, seed, stall_at=None, diverge_at=None):
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    lines = []
    for check in range(1, CHECKS + 1):
        step = check * INTERVAL
        for s in range(step - INTERVAL + 1, step + 1):
            loss = 5.0 - 0.0003 * s if diverge_at is None or s < diverge_at else 9.0
            lines.append({"step": s, "train/loss": loss})
        progress = check if stall_at is None else min(check, stall_at // INTERVAL)
        lines.append({"step": step, "monitor/attention/layer0/H_D2_mean":
                      1.0 + 0.01 * progress + 0.005 * rng.standard_normal(),
                      "monitor/attention/layer0/H_dWq": 3.0 + 0.002 * rng.standard_normal(),
                      "monitor/attention/layer0/H_dWk": 3.0 + 0.002 * rng.standard_normal()})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_compare_reports_leave_one_out_reference_alarms_and_leads(tmp_path):
    scenario = Scenario("synthetic", "", [], [], [1, 2, 3], [1], "control", {
        "control": [], "fault": [], "fault-late": ["--attention-fault-start", "2000"]})
    for seed in (1, 2, 3):
        _write_run(tmp_path / f"control-seed{seed}", seed)
        _write_run(tmp_path / f"fault-seed{seed}", 10 + seed, stall_at=1000, diverge_at=2500)
        _write_run(tmp_path / f"fault-late-seed{seed}", 20 + seed, stall_at=2000)
    result = compare(scenario, tmp_path)
    rows = {(r["variant"], r["seed"]): r for r in result["rows"]}
    for seed in (1, 2, 3):
        assert rows[("control", seed)]["alarms"]["reference"]["D2"] is None
        fault = rows[("fault", seed)]
        assert fault["divergence"] is not None and 2500 <= fault["divergence"] <= 2525
        assert 1000 < fault["alarms"]["reference"]["D2"] < fault["divergence"]
        assert 1000 < fault["alarms"]["trend"]["D2"] < fault["divergence"]
        late = rows[("fault-late", seed)]
        assert late["fault_start"] == 2000 and late["alarms"]["reference"]["D2"] > 2000
    summary = result["summary"]["reference/D2"]
    assert summary["false_alarm_runs"] == 0 and summary["fault_runs_alarmed"] == 6
    assert summary["alarmed_before_divergence"] == 3 and summary["median_lead"] > 0
    assert result["summary"]["trend/dW"]["false_alarm_runs"] == 0  # flat noise
