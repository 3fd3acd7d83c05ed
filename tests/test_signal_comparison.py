"""`compare-signals` arithmetic on synthetic run directories: the share of the low path's
loss gap a variant recovers, paired by seed."""

import json

import pytest

from megatron_gnmr.experiments.scenario import Scenario
from megatron_gnmr.experiments.signal_comparison import compare


def _write_run(path, tail_loss, valid_loss):
    path.mkdir(parents=True)
    lines = [{"step": s, "train/loss": 6.0 if s <= 90 else tail_loss} for s in range(1, 101)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (path / "summary.json").write_text(json.dumps({"final_valid_loss": valid_loss}))


def test_gap_recovered_is_paired_by_seed(tmp_path):
    scenario = Scenario("synthetic", "", [], [], [1, 2], [1], "low",
                        {"low": [], "high": [], "rule": []})
    # seed 1: low 4.10, high 4.00, rule 4.05 -> 0.5; seed 2: low 4.30, high 4.10, rule 4.25
    # -> 0.25 (a different level per seed: only the paired ratio is comparable)
    for seed, (low, high, rule) in {1: (4.10, 4.00, 4.05), 2: (4.30, 4.10, 4.25)}.items():
        for variant, loss in (("low", low), ("high", high), ("rule", rule)):
            _write_run(tmp_path / f"{variant}-seed{seed}", loss, loss + 0.1)
    result = compare(scenario, tmp_path, "low", "high")
    row = result["rows"]["rule"]
    assert row["per_seed_recovered"] == pytest.approx([0.5, 0.25])
    assert row["gap_recovered"][0] == pytest.approx(0.375)
    assert row["valid_gap_recovered"][0] == pytest.approx(0.375)
    assert result["rows"]["high"]["gap_recovered"][0] == pytest.approx(1.0)
